"""``ds_all.runtime.fp16.loss_scaler``: DeepSpeed's loss-scaler objects (ds-zero's), driven through scripted
overflow / clean sequences and checked step by step against DeepSpeed 0.19.8's rules, worked out here by
hand and by a reference written as a count of clean steps (not as the scaler's iteration arithmetic)."""

from __future__ import annotations

import importlib
import random

import pytest
import torch

import ds_zero

X, C = True, False  # an overflow, a clean step


def scales(scaler, overflows):
    out = []
    for overflow in overflows:
        scaler.update_scale(overflow)
        out.append(scaler.cur_scale)
    return out


def dynamic(init_scale=16.0, scale_window=3, min_scale=1.0, delayed_shift=1, consecutive_hysteresis=False,
            **kwargs):
    from ds_all.runtime.fp16.loss_scaler import DynamicLossScaler

    return DynamicLossScaler(init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis, **kwargs)


def reference(overflows, init_scale, window, min_scale, hysteresis, consecutive, raise_at_min=True):
    """DeepSpeed's rules as a story of runs: an overflow spends one unit of hysteresis while more than one is
    left, else halves the scale (not below the floor; at the floor: an error when asked). A clean step that
    follows a run of k clean steps (k > 0, a multiple of the window) since the last overflow or the start
    doubles the scale and refills the hysteresis; with consecutive hysteresis every clean step refills it."""
    scale, left, run, out = init_scale, hysteresis, 0, []
    for overflow in overflows:
        if overflow:
            if left > 1:
                left -= 1
            elif scale == min_scale and raise_at_min:
                out.append("error")
                return out
            else:
                scale = max(scale / 2, min_scale)
            run = 0
        else:
            if consecutive:
                left = hysteresis
            if run > 0 and run % window == 0:
                scale *= 2
                left = hysteresis
            run += 1
        out.append(scale)
    return out


# ---- worked by hand ----

def test_clean_steps_double_the_scale_after_each_full_window():
    # iteration k (from 0) is clean; the clean steps before it are k: doubling at k = 3, 6, 9 (window 3)
    assert scales(dynamic(init_scale=4.0), [C] * 10) == [4, 4, 4, 8, 8, 8, 16, 16, 16, 32]


def test_an_overflow_halves_and_restarts_the_window():
    # overflow at 1 halves 16 -> 8; the clean steps before iteration k are then k - 2: doubling at 5, 8
    assert scales(dynamic(), [C, X, C, C, C, C, C, C, C]) == [16, 8, 8, 8, 8, 16, 16, 16, 32]


def test_hysteresis_delays_the_halving():
    # delayed_shift 2: the first overflow (0) spends the hysteresis, the second (1) halves; clean steps 2-4,
    # then 5 doubles (three clean steps before it) and refills the hysteresis, so 6 spends it again
    scaler = dynamic(delayed_shift=2)
    assert scales(scaler, [X, X, C, C, C, C, X, X]) == [16, 8, 8, 8, 8, 16, 16, 8]
    assert scaler.cur_hysteresis == 1 and scaler.last_overflow_iter == 7 and scaler.cur_iter == 8


def test_consecutive_hysteresis_refills_after_any_clean_step():
    plain = dynamic(delayed_shift=2, scale_window=100)
    assert scales(plain, [X, C, X, C, X]) == [16, 16, 8, 8, 4]  # the hysteresis, once spent, stays spent
    consecutive = dynamic(delayed_shift=2, scale_window=100, consecutive_hysteresis=True)
    assert scales(consecutive, [X, C, X, C, X, X]) == [16, 16, 16, 16, 16, 8]  # only two in a row halve


def test_the_floor():
    scaler = dynamic(init_scale=8.0, min_scale=3.0)
    assert scales(scaler, [X, X]) == [4, 3]  # halving stops at min_scale
    with pytest.raises(RuntimeError, match=r"loss scale already at its minimum \(3\)"):
        scaler.update_scale(True)
    lenient = dynamic(init_scale=4.0, min_scale=2.0, raise_error_at_min_scale=False)
    assert scales(lenient, [X, X, X, C, C, C, C]) == [2, 2, 2, 2, 2, 2, 4]


# ---- against the run-count reference on random sequences ----

@pytest.mark.parametrize("window, hysteresis, consecutive", [(1, 1, False), (2, 1, False), (3, 2, False),
                                                            (4, 3, True), (2, 2, True), (5, 4, False)])
def test_random_sequences_follow_deepspeeds_rules(window, hysteresis, consecutive):
    rng = random.Random(window * 100 + hysteresis * 10 + consecutive)
    for trial in range(30):
        overflows = [rng.random() < 0.35 for _ in range(60)]
        scaler = dynamic(init_scale=2.0 ** 12, scale_window=window, min_scale=0.5, delayed_shift=hysteresis,
                         consecutive_hysteresis=consecutive, raise_error_at_min_scale=False)
        want = reference(overflows, 2.0 ** 12, window, 0.5, hysteresis, consecutive, raise_at_min=False)
        assert scales(scaler, overflows) == want, (trial, overflows)


# ---- the rest of DeepSpeed's surface ----

def test_attributes_and_loss_scaling():
    scaler = dynamic(init_scale=2.0 ** 10, scale_window=50, min_scale=0.25, delayed_shift=2)
    assert (scaler.cur_scale, scaler.loss_scale, scaler.cur_iter, scaler.last_overflow_iter) == (1024, 1024, 0, -1)
    assert (scaler.scale_factor, scaler.scale_window, scaler.min_scale, scaler.delayed_shift) == (2.0, 50, 0.25, 2)
    assert (scaler.cur_hysteresis, scaler.consecutive_hysteresis, scaler.raise_error_at_min_scale) == (2, False, True)
    assert scaler.dynamic is True and scaler.dtype is torch.half

    weight = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    loss = (weight * torch.tensor([3.0, 5.0])).sum()
    assert float(scaler.scale_loss(loss).detach()) == pytest.approx(1024 * -7.0)
    scaler.backward(loss)
    assert weight.grad.tolist() == [3.0 * 1024, 5.0 * 1024]
    assert not scaler.has_overflow([weight]) and not scaler.has_overflow_serial([weight])
    weight.grad[1] = float("inf")
    assert scaler.has_overflow([weight]) and scaler.has_overflow(iter([torch.nn.Parameter(torch.ones(1)), weight]))
    weight.grad[1] = float("nan")
    assert scaler.has_overflow([weight])
    grads = scaler.scale_gradient(None, (torch.ones(2), None), None)
    assert grads[0].tolist() == [1024.0, 1024.0] and grads[1] is None


def test_static_scaler_and_the_factory():
    from ds_all.runtime.fp16 import loss_scaler

    static = loss_scaler.LossScaler()
    assert static.cur_scale == static.loss_scale == 1 and static.dynamic is False
    weight = torch.nn.Parameter(torch.ones(1))
    weight.grad = torch.tensor([float("inf")])
    assert static.has_overflow([weight]) is False  # a static scale never sees an overflow (DeepSpeed's)
    assert scales(loss_scaler.LossScaler(128), [X, C, X]) == [128, 128, 128]

    keys = {loss_scaler.INITIAL_LOSS_SCALE: 2.0 ** 16, loss_scaler.SCALE_WINDOW: 1000, loss_scaler.MIN_LOSS_SCALE: 1,
            loss_scaler.DELAYED_SHIFT: 2, loss_scaler.CONSECUTIVE_HYSTERESIS: False}
    made = loss_scaler.CreateLossScaler(torch.half, 0, True, keys)
    assert isinstance(made, loss_scaler.DynamicLossScaler)
    assert (made.cur_scale, made.scale_window, made.min_scale, made.delayed_shift) == (65536, 1000, 1, 2)
    static_half = loss_scaler.CreateLossScaler(torch.half, 64, False, None)
    assert type(static_half) is loss_scaler.LossScaler and static_half.cur_scale == 64
    for dtype in (torch.bfloat16, torch.float32):  # nothing to scale: 1, whatever was asked
        other = loss_scaler.CreateLossScaler(dtype, 64, True, keys)
        assert type(other) is loss_scaler.LossScaler and other.cur_scale == 1.0
    with pytest.raises(ValueError, match=r"dynamic float16 loss scaling needs dynamic_loss_args"):
        loss_scaler.CreateLossScaler(torch.half, 0, True, None)
    with pytest.raises(ValueError, match=r"unknown keys \['scale_windw'\] and lacks \['scale_window'\]"):
        loss_scaler.CreateLossScaler(torch.half, 0, True, {**{k: v for k, v in keys.items() if k != "scale_window"},
                                                           "scale_windw": 10})


def test_the_module_is_ds_zeros_and_a_module_of_the_tree():
    module = importlib.import_module("ds_all.runtime.fp16.loss_scaler")
    for name in ("DynamicLossScaler", "LossScaler", "LossScalerBase", "CreateLossScaler"):
        assert getattr(module, name) is getattr(ds_zero, name)
    import ds_all

    assert ds_all.runtime.fp16.loss_scaler is module


@pytest.mark.parametrize("kwargs, message", [
    (dict(scale_window=0), r"scale_window must be an integer >= 1, got 0"),
    (dict(delayed_shift=0), r"delayed_shift must be an integer >= 1, got 0"),
    (dict(init_scale=0.0), r"the loss scale must be a finite number > 0, got 0\.0"),
    (dict(min_scale=-1.0), r"min_scale must be a finite number >= 0, got -1\.0"),
    (dict(consecutive_hysteresis="no"), r"consecutive_hysteresis must be true or false, got 'no'"),
])
def test_bad_arguments_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dynamic(**kwargs)
