"""The learning-rate schedules where DeepSpeed 0.19.8 accepts what an earlier version of ours refused: each
case is compared step by step with DeepSpeed's formulas, written out here as DeepSpeed's
``deepspeed/runtime/lr_schedules.py`` computes them (never by calling the schedules), and where DeepSpeed
falls back we check the one warning that names the value."""

from __future__ import annotations

import contextlib
import logging
import math

import pytest
import torch

from ds_all import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

STEPS = 160


@contextlib.contextmanager
def warnings_of_ds_all():
    """The WARNING records logged under ``ds_all`` (its progress logger may not propagate to the root)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    log = logging.getLogger("ds_all")
    log.addHandler(handler)
    try:
        yield records
    finally:
        log.removeHandler(handler)


def adam(lrs=(0.01,), betas=(0.9, 0.999)):
    return torch.optim.Adam([{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs], betas=betas)


def rates(schedule, steps=STEPS, key="lr"):
    """Per step() call (1 .. steps) the value of ``key`` of every group (``beta1``: betas[0])."""
    out = []
    for _ in range(steps):
        schedule.step()
        groups = schedule.optimizer.param_groups
        out.append([g["betas"][0] if key == "beta1" else g[key] for g in groups])
    return out


def close(got, want):
    assert len(got) == len(want)
    for n, (g, w) in enumerate(zip(got, want, strict=True), start=1):
        assert g == pytest.approx(w, rel=1e-9, abs=1e-15), f"after step() {n}: {g} != {w}"


# ---- DeepSpeed's formulas, as its schedules compute them from last_batch_iteration (i) ----

def ds_warmup_gamma(i, warmup, kind):
    warmup = max(2, warmup)
    if kind == "linear":
        return i / warmup
    return (1.0 / math.log(warmup)) * math.log(i + 1)


def ds_warmup_decay(i, low, high, warmup, total, kind="log"):
    w = max(2, warmup)
    gamma = ds_warmup_gamma(i, warmup, kind) if i < w else max(0.0, float(total - i) / float(max(1.0, total - w)))
    return low + (high - low) * gamma


def ds_cosine(i, base, total, warmup, min_ratio, cos_min, kind="log"):
    w = max(2, warmup)
    if i < w:
        return base * (min_ratio + ds_warmup_gamma(i, warmup, kind) * (1.0 - min_ratio))
    progress = min(1.0, (i - w + 1) / max(1, total - w))
    return base * max(0.0, cos_min + (1.0 - cos_min) * (1 + math.cos(math.pi * progress)) / 2)


def ds_one_cycle_scale(i, first, second, first_stairs, second_stairs):
    total = first + second
    b = i + 1
    cycle = math.floor(1 + b / total)
    x = 1.0 + b / total - cycle
    step_ratio = first / total
    if x <= step_ratio:
        scale, stairs = x / step_ratio, first_stairs
    else:
        scale, stairs = (x - 1) / (step_ratio - 1), second_stairs
    if stairs > 0:
        at = b % total
        position = at * stairs / first if at <= first else (total - at) * stairs / second
        scale = math.floor(position) / stairs
    return scale


def ds_one_cycle(i, low, high, mom_low, mom_high, first, second=None, first_stairs=0, second_stairs=None,
                 decay_step=0, lr_rate=0.0, mom_rate=0.0):
    """(lr, momentum) at iteration i."""
    second = first if second is None else second
    second_stairs = first_stairs if second_stairs is None else second_stairs
    if i < first + second:
        scale = ds_one_cycle_scale(i, first, second, first_stairs, second_stairs)
        return low + (high - low) * scale, mom_high - (mom_high - mom_low) * scale
    past = i - (first + second) + 1
    lr = low if decay_step == 0 or lr_rate == 0 else low / (1 + lr_rate * past / decay_step)
    mom = mom_high if decay_step == 0 or mom_rate == 0 else mom_high * (1 + mom_rate * past / decay_step)
    return lr, mom


# ---- WarmupCosineLR / WarmupDecayLR with total_num_steps at or below warmup_num_steps ----

@pytest.mark.parametrize("total, warmup", [(40, 40), (25, 40), (1, 1)])
def test_warmup_cosine_total_at_or_below_the_warmup(total, warmup):
    base = (0.01, 0.004)
    with warnings_of_ds_all() as warned:
        schedule = WarmupCosineLR(adam(base), total, warmup_min_ratio=0.1, warmup_num_steps=warmup, cos_min_ratio=0.02)
    got = rates(schedule)
    for g, lr in enumerate(base):
        close([row[g] for row in got], [ds_cosine(i, lr, total, warmup, 0.1, 0.02) for i in range(STEPS)])
        assert got[max(2, warmup)][g] == pytest.approx(lr * 0.02)  # the floor right after the warmup
    short = total < max(2, warmup)  # DeepSpeed warns only below (warmup_num_steps counts at least 2)
    assert len(warned) == short
    if short:
        assert f"total_num_steps ({total}) is less than warmup_num_steps ({max(2, warmup)}" in warned[0].getMessage()


def test_warmup_decay_total_below_the_warmup_warns_and_drops_to_the_minimum():
    with warnings_of_ds_all() as warned:
        schedule = WarmupDecayLR(adam(), 30, warmup_min_lr=1e-4, warmup_max_lr=1e-3, warmup_num_steps=50)
    assert len(warned) == 1 and "total_num_steps (30) is less than warmup_num_steps (50" in warned[0].getMessage()
    got = [row[0] for row in rates(schedule)]
    close(got, [ds_warmup_decay(i, 1e-4, 1e-3, 50, 30) for i in range(STEPS)])
    assert got[49] == pytest.approx(1e-3) and got[50] == pytest.approx(1e-4)  # the top, then straight down


# ---- an unknown warmup_type: "log", and one warning naming it ----

@pytest.mark.parametrize("make", [
    lambda o, t: WarmupLR(o, 0.0, 1e-3, 30, t),
    lambda o, t: WarmupDecayLR(o, 100, 0.0, 1e-3, 30, t),
    lambda o, t: WarmupCosineLR(o, 100, 0.0, 30, 0.01, t),
], ids=["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"])
def test_an_unknown_warmup_type_falls_back_to_log_with_one_warning(make):
    with warnings_of_ds_all() as warned:
        unknown = make(adam(), "Linear")
    assert len(warned) == 1
    assert "'Linear'" in warned[0].getMessage() and "using 'log'" in warned[0].getMessage()
    assert unknown.warmup_type == "log"
    with warnings_of_ds_all() as quiet:
        log = make(adam(), "log")
    assert quiet == []
    got = rates(unknown)
    assert got == rates(log) == rates(make(adam(), None))  # not even a string: "log" too
    base = 1e-3 if unknown.__class__ is not WarmupCosineLR else 0.01  # the cosine's: the optimizer's lr
    close([row[0] for row in got[:30]], [base * ds_warmup_gamma(i, 30, "log") for i in range(30)])


# ---- OneCycle: cycle_second_step_size 0, stairs, decay without decay_step_size ----

@pytest.mark.parametrize("stairs", [0, 4])
def test_one_cycle_with_no_second_half(stairs):
    params = dict(cycle_first_step_size=20, cycle_second_step_size=0, cycle_first_stair_count=stairs,
                  decay_step_size=10, decay_lr_rate=0.5, decay_mom_rate=0.01, cycle_min_mom=0.85, cycle_max_mom=0.95)
    schedule = OneCycle(adam(), 1e-4, 1e-3, **params)
    got_lr, got_mom = [], []
    for _ in range(STEPS):
        schedule.step()
        got_lr.append(schedule.optimizer.param_groups[0]["lr"])
        got_mom.append(schedule.optimizer.param_groups[0]["betas"][0])
    want = [ds_one_cycle(i, 1e-4, 1e-3, 0.85, 0.95, 20, 0, stairs, None, 10, 0.5, 0.01) for i in range(STEPS)]
    close(got_lr, [w[0] for w in want])
    close(got_mom, [w[1] for w in want])
    assert got_lr[18] == pytest.approx(1e-4 + 9e-4 * (19 // 5 * 5 / 20 if stairs else 19 / 20))  # near the top
    assert got_lr[19] == pytest.approx(1e-4)  # the cycle's last iteration: back at the bottom, as DeepSpeed
    assert got_lr[20] == pytest.approx(1e-4 / (1 + 0.5 * 1 / 10))  # then the decay


@pytest.mark.parametrize("first, second, first_stairs, second_stairs", [
    (10, 4, 20, None),  # more stairs than iterations in a half: DeepSpeed's floor still applies
    (12, 30, 5, 7), (9, 9, 3, 0), (25, 5, 0, 3),
])
def test_one_cycle_staircases_as_deepspeed_computes_them(first, second, first_stairs, second_stairs):
    schedule = OneCycle(adam(), 0.1, 0.5, cycle_first_step_size=first, cycle_second_step_size=second,
                        cycle_first_stair_count=first_stairs, cycle_second_stair_count=second_stairs)
    got = [row[0] for row in rates(schedule, steps=2 * (first + second))]
    close(got, [ds_one_cycle(i, 0.1, 0.5, 0.8, 0.9, first, second, first_stairs, second_stairs)[0]
                for i in range(2 * (first + second))])


@pytest.mark.parametrize("rate_name", ["decay_lr_rate", "decay_mom_rate"])
def test_a_decay_rate_without_decay_step_size_is_ignored_with_a_warning(rate_name):
    with warnings_of_ds_all() as warned:
        schedule = OneCycle(adam(betas=(0.9, 0.99)), 1e-4, 1e-3, cycle_first_step_size=5, **{rate_name: 0.25})
    assert len(warned) == 1 and f"{rate_name} (0.25) has no effect with decay_step_size 0" in warned[0].getMessage()
    got = rates(schedule, steps=40)
    assert [row[0] for row in got[10:]] == pytest.approx([1e-4] * 30)  # no decay after the cycle
    assert [row[0] for row in rates(schedule, steps=5, key="beta1")] == pytest.approx([0.9] * 5)


# ---- OneCycle's momentum: betas = (momentum, 0.99) in every group, per-group lists ----

def test_one_cycle_writes_beta1_of_every_group_from_per_group_lists():
    lows, highs, mom_lows, mom_highs = [1e-4, 2e-4], [1e-3, 4e-3], [0.8, 0.85], [0.9, 0.97]
    opt = adam(lrs=(0.5, 0.5), betas=(0.5, 0.999))
    params = dict(cycle_first_step_size=15, cycle_second_step_size=25, decay_step_size=7, decay_lr_rate=0.2,
                  decay_mom_rate=0.003)
    with warnings_of_ds_all() as warned:
        schedule = OneCycle(opt, lows, highs, cycle_min_mom=mom_lows, cycle_max_mom=mom_highs, **params)
    assert len(warned) == 1 and "beta2 [0.999] is replaced by 0.99" in warned[0].getMessage()
    # DeepSpeed's construction: the cycle's lowest momentum, beta2 0.99
    assert [g["betas"] for g in opt.param_groups] == [(0.8, 0.99), (0.85, 0.99)]
    lr_rows, beta_rows = [], []
    for _ in range(STEPS):
        schedule.step()
        lr_rows.append([g["lr"] for g in opt.param_groups])
        beta_rows.append([g["betas"] for g in opt.param_groups])
    for g in range(2):
        want = [ds_one_cycle(i, lows[g], highs[g], mom_lows[g], mom_highs[g], 15, 25, 0, None, 7, 0.2, 0.003)
                for i in range(STEPS)]
        close([row[g] for row in lr_rows], [w[0] for w in want])
        close([row[g][0] for row in beta_rows], [w[1] for w in want])
        assert {row[g][1] for row in beta_rows} == {0.99}  # DeepSpeed writes (momentum, 0.99)
    assert beta_rows[14][1][0] == pytest.approx(0.85)  # the top of the rate, the bottom of the momentum


def test_one_cycle_leaves_sgds_momentum_alone_as_deepspeed_does():
    opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(2)], lr=0.1, momentum=0.5)
    with warnings_of_ds_all() as warned:
        schedule = OneCycle(opt, [0.01, 0.02], [0.1, 0.2], cycle_first_step_size=8, cycle_min_mom=[0.8, 0.7],
                            cycle_max_mom=0.9)
    assert len(warned) == 1 and "SGD has no 'betas' in its defaults" in warned[0].getMessage()
    got = rates(schedule, steps=30, key="momentum")
    assert {m for row in got for m in row} == {0.5}
    close([row[1] for row in rates(schedule, steps=5)], [0.02] * 5)  # past the cycle, at cycle_min_lr


def test_one_cycle_with_an_optimizer_without_momentum_warns_and_cycles_only_the_rate():
    opt = torch.optim.Adagrad([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with warnings_of_ds_all() as warned:
        schedule = OneCycle(opt, 0.01, 0.1, cycle_first_step_size=5)
    assert len(warned) == 1 and "has no 'betas' in its defaults" in warned[0].getMessage()
    assert "Adagrad" in warned[0].getMessage()
    assert schedule.cycle_momentum is False and schedule.get_mom() is None
    got = [row[0] for row in rates(schedule, steps=20)]
    close(got, [ds_one_cycle(i, 0.01, 0.1, 0.8, 0.9, 5)[0] for i in range(20)])
    assert "momentum" not in opt.param_groups[0] and "betas" not in opt.param_groups[0]


# ---- per-group lists of the other schedules ----

def test_warmup_lr_and_lr_range_test_take_a_rate_per_group():
    warm = WarmupLR(adam(lrs=(1.0, 1.0, 1.0)), [0.0, 1e-4, 2e-4], [1e-3, 2e-3, 3e-3], 25, "linear")
    got = rates(warm)
    for g, (low, high) in enumerate(zip([0.0, 1e-4, 2e-4], [1e-3, 2e-3, 3e-3], strict=True)):
        close([row[g] for row in got], [low + (high - low) * (ds_warmup_gamma(i, 25, "linear") if i < 25 else 1.0)
                                        for i in range(STEPS)])
    test = LRRangeTest(adam(lrs=(1.0, 1.0)), (1e-4, 5e-4), lr_range_test_step_size=9, lr_range_test_step_rate=0.5,
                       lr_range_test_staircase=True)
    got = rates(test)
    for g, low in enumerate((1e-4, 5e-4)):
        close([row[g] for row in got], [low * (1 + 0.5 * math.floor(float(i + 1) / 9)) for i in range(STEPS)])
    with pytest.raises(ValueError, match=r"lr_range_test_min_lr must be one number or a list of one per param group "
                                         r"\(2\), got a list of 3"):
        LRRangeTest(adam(lrs=(1.0, 1.0)), [1e-4] * 3)
