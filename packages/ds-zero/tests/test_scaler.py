"""fp16 loss scaling follows the reference's window / hysteresis / floor rules on scripted sequences
(the expected scales are worked out by hand from the rules, step by step)."""

from __future__ import annotations

import pytest

from ds_zero import FP16Config
from ds_zero._scaler import LossScaler


def _run(config: FP16Config, overflows: list[bool]) -> list[float]:
    scaler = LossScaler(config)
    out = []
    for overflow in overflows:
        scaler.update(overflow)
        out.append(scaler.scale)
    return out


def test_window_and_hysteresis():
    config = FP16Config(enabled=True, initial_scale_power=4, loss_scale_window=3, hysteresis=2)
    X, C = True, False  # overflow, clean
    # step 0: the first overflow spends the hysteresis (16 stays); step 1: halved to 8; steps 2-4: clean,
    # but DeepSpeed 0.19 doubles only once the steps *before* the current one fill the window (3 clean
    # steps, then a 4th); 5: the hysteresis is still spent, halved to 4; 7: halved to 2; 8-10: not yet.
    assert _run(config, [X, X, C, C, C, X, C, X, C, C, C]) == [16, 8, 8, 8, 8, 4, 4, 2, 2, 2, 2]
    assert _run(config, [X, X, C, C, C, C, X]) == [16, 8, 8, 8, 8, 16, 16]  # step 5 doubles and refills


def test_consecutive_hysteresis_needs_consecutive_overflows():
    config = FP16Config(enabled=True, initial_scale_power=4, loss_scale_window=100, hysteresis=2,
                        consecutive_hysteresis=True)
    X, C = True, False  # overflow, clean
    assert _run(config, [X, C, X, C, X, X]) == [16, 16, 16, 16, 16, 8]
    plain = config.model_copy(update={"consecutive_hysteresis": False})
    assert _run(plain, [X, C, X]) == [16, 16, 8]


def test_clean_steps_double_every_window():
    config = FP16Config(enabled=True, initial_scale_power=2, loss_scale_window=2)
    # steps count from 0 and the last overflow from -1: the window (2) of clean steps before the current
    # one is full at steps 2 and 4 (DeepSpeed 0.19's count)
    assert _run(config, [False] * 6) == [4, 4, 8, 8, 16, 16]


def test_the_engines_scaler_and_deepspeeds_loss_scaler_agree_on_random_sequences():
    import random

    from ds_zero import DynamicLossScaler

    rng = random.Random(0)
    for _ in range(300):
        overflows = [rng.random() < 0.2 for _ in range(40)]
        window, hysteresis, consecutive = rng.randint(1, 5), rng.randint(1, 3), rng.random() < 0.5
        config = FP16Config(enabled=True, initial_scale_power=20, loss_scale_window=window, hysteresis=hysteresis,
                            consecutive_hysteresis=consecutive)
        deepspeeds = DynamicLossScaler(init_scale=2.0 ** 20, scale_window=window, min_scale=1,
                                       delayed_shift=hysteresis, consecutive_hysteresis=consecutive)
        want = []
        for overflow in overflows:
            deepspeeds.update_scale(overflow)
            want.append(deepspeeds.cur_scale)
        assert _run(config, overflows) == want, (overflows, window, hysteresis, consecutive)


def test_floor_and_overflow_at_the_floor():
    config = FP16Config(enabled=True, initial_scale_power=3, hysteresis=1, min_loss_scale=4)
    scaler = LossScaler(config)
    scaler.update(True)
    assert scaler.scale == 4
    with pytest.raises(RuntimeError, match="overflow at the minimum loss scale 4"):
        scaler.update(True)
    odd = LossScaler(FP16Config(enabled=True, initial_scale_power=3, hysteresis=1, min_loss_scale=3))
    odd.update(True)
    assert odd.scale == 4 and (odd.update(True) or odd.scale == 3)  # halving stops at the floor


def test_static_scale_never_changes():
    assert _run(FP16Config(enabled=True, loss_scale=128), [True, False, True] * 3) == [128.0] * 9


def test_state_round_trip():
    config = FP16Config(enabled=True, initial_scale_power=4, loss_scale_window=3, hysteresis=2)
    a = LossScaler(config)
    for overflow in (True, True, False):
        a.update(overflow)
    b = LossScaler(config)
    b.load_state_dict(a.state_dict())
    for overflow in (False, False, True, True):
        a.update(overflow)
        b.update(overflow)
        assert a.scale == b.scale
    with pytest.raises(ValueError, match="lacks"):
        b.load_state_dict({"scale": 1.0})
