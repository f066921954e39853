"""ds_all's learning-rate schedules against closed forms written here from DeepSpeed's formulas (never by
calling the schedules), at every step for a few hundred steps; the config path; the bad inputs."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from ds_config import ConfigError

import ds_all
from ds_all import (
    LRRangeTest,
    OneCycle,
    SchedulerConfig,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)

README = Path(__file__).resolve().parents[1] / "README.md"
CONFIGS = Path(__file__).parent / "fixtures" / "deepspeed_configs"
STEPS = 300


def optimizer(kind: str = "adam", lrs: tuple[float, ...] = (0.01,), betas=(0.9, 0.95)):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    if kind == "adam":
        return torch.optim.Adam(groups, betas=betas)
    if kind == "sgd":
        return torch.optim.SGD(groups, momentum=0.5)
    return torch.optim.Adagrad(groups)


def trace(schedule, steps: int = STEPS):
    """The lrs of every group at construction (index 0) and after each step() (index n)."""
    lrs = [[g["lr"] for g in schedule.optimizer.param_groups]]
    for _ in range(steps):
        schedule.step()
        lrs.append([g["lr"] for g in schedule.optimizer.param_groups])
        assert schedule.get_last_lr() == lrs[-1]
    return lrs


def assert_close(got, want, what=""):
    assert len(got) == len(want)
    for n, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == pytest.approx(w, rel=1e-12, abs=1e-15), f"{what} step {n}: {g} != {w}"


# ---- the closed forms: lr after n step() calls (n = 0: at construction), i = n - 1 the last iteration ----

def warm(kind: str, i: int, steps: int) -> float:
    steps = max(steps, 2)
    return math.log2(i + 1) / math.log2(steps) if kind == "log" else Fraction(i, steps)


def ref_warmup(n, low, high, steps, kind, total=None):
    i, w = n - 1, max(steps, 2)
    if i < 0:
        return low
    if i < w:
        return low + (high - low) * float(warm(kind, i, steps))
    if total is None:
        return high
    return low + (high - low) * max(0.0, (total - i) / max(1, total - w))


def ref_cosine(n, base, total, min_ratio, steps, cos_min, kind):
    i, w = n - 1, max(steps, 2)
    if i < 0:
        return base * min_ratio
    if i < w:
        return base * (min_ratio + (1 - min_ratio) * float(warm(kind, i, steps)))
    half_turn = min(i + 1 - w, total - w) / (total - w) * math.pi / 2
    return base * (cos_min + (1 - cos_min) * math.cos(half_turn) ** 2)


def ref_lrrt(n, low, size, rate, staircase):
    done = n  # iterations completed
    return low * (1 + rate * (done // size if staircase else done / size))


def ref_onecycle(n, lo, hi, up, down=None, up_stairs=0, down_stairs=None, decay=0, lr_rate=0.0,
                 mom=(0.8, 0.9), mom_rate=0.0):
    """(lr, momentum) after n steps."""
    down = up if down is None else down
    down_stairs = up_stairs if down_stairs is None else down_stairs
    b = n % (up + down)  # position in the cycle: iterations done, 0 again at the cycle's last iteration
    if n - 1 < up + down:
        if b <= up:  # rising: the fraction of the first half done, floored to a stair
            h = Fraction(b, up)
            if up_stairs:
                h = Fraction(math.floor(h * up_stairs), up_stairs)
        else:  # falling: the fraction of the second half still to go, floored to a stair
            h = Fraction(up + down - b, down)
            if down_stairs:
                h = Fraction(math.floor(h * down_stairs), down_stairs)
        return lo + (hi - lo) * float(h), mom[1] - (mom[1] - mom[0]) * float(h)
    past = n - up - down
    lr_factor = 1 + lr_rate * past / decay if decay else 1.0
    mom_factor = 1 + mom_rate * past / decay if decay else 1.0
    return lo / lr_factor, mom[1] * mom_factor


def test_the_references_hit_the_points_known_by_hand():
    assert ref_warmup(0, 0.1, 1.0, 10, "log") == 0.1 == ref_warmup(1, 0.1, 1.0, 10, "log")
    assert ref_warmup(10, 0.0, 1.0, 10, "log") == pytest.approx(1.0)  # iteration 9: ln 10 / ln 10
    assert ref_warmup(6, 0.0, 1.0, 10, "linear") == pytest.approx(0.5)  # iteration 5 of 10
    assert ref_warmup(111, 0.0, 1.0, 10, "log", total=110) == 0.0  # iteration 110 = total
    assert ref_cosine(100, 2.0, 100, 0.0, 10, 0.25, "linear") == pytest.approx(0.5)
    assert ref_cosine(55, 2.0, 100, 0.0, 10, 0.0, "linear") == pytest.approx(1.0)  # halfway down
    assert ref_onecycle(10, 1.0, 3.0, 10) == pytest.approx((3.0, 0.8))  # the top
    assert ref_onecycle(20, 1.0, 3.0, 10) == pytest.approx((1.0, 0.9))  # back at the bottom
    assert ref_onecycle(3, 0.0, 1.0, 10, up_stairs=5)[0] == pytest.approx(0.2)  # stairs of 2 steps
    assert ref_onecycle(30, 1.0, 3.0, 10, decay=10, lr_rate=1.0)[0] == pytest.approx(0.5)
    assert ref_lrrt(7, 1.0, 3, 1.0, True) == 3.0 and ref_lrrt(6, 1.0, 4, 2.0, False) == 4.0


# ---- each schedule at every step ----

@pytest.mark.parametrize("low, high, steps, kind, lrs", [
    (0.0, 1e-3, 100, "log", (0.01,)),
    (1e-5, 1e-2, 37, "linear", (0.01,)),
    ([0.0, 1e-4], [1e-3, 5e-3], 50, "log", (0.01, 0.02)),
    (0.0, 1e-3, 0, "log", (0.01,)),       # 0 counts as 2
    (1e-4, 1e-3, 1, "linear", (0.01,)),   # 1 counts as 2
    (0.0, None, 64, "linear", (0.01, 0.03)),  # max: each group's own lr
])
def test_warmup_lr(low, high, steps, kind, lrs):
    schedule = WarmupLR(optimizer(lrs=lrs), low, high, steps, kind)
    lows = low if isinstance(low, list) else [low] * len(lrs)
    highs = high if isinstance(high, list) else list(lrs) if high is None else [high] * len(lrs)
    got = trace(schedule)
    for g in range(len(lrs)):
        assert_close([row[g] for row in got], [ref_warmup(n, lows[g], highs[g], steps, kind) for n in range(STEPS + 1)])


@pytest.mark.parametrize("total, low, high, steps, kind", [
    (250, 0.0, 1e-3, 50, "log"), (200, 1e-4, 2e-3, 40, "linear"), (120, 0.0, 1e-3, 120, "linear"),
    (10, 0.0, 1e-3, 1, "log"),
])
def test_warmup_decay_lr(total, low, high, steps, kind):
    got = [row[0] for row in trace(WarmupDecayLR(optimizer(), total, low, high, steps, kind))]
    assert_close(got, [ref_warmup(n, low, high, steps, kind, total) for n in range(STEPS + 1)])
    assert got[-1] == pytest.approx(low)  # past total_num_steps: back at the minimum


@pytest.mark.parametrize("total, min_ratio, steps, cos_min, kind", [
    (200, 0.0, 20, 1e-4, "log"), (250, 0.1, 50, 0.05, "linear"), (100, 0.5, 1, 0.0, "linear"),
])
def test_warmup_cosine_lr_on_two_groups(total, min_ratio, steps, cos_min, kind):
    got = trace(WarmupCosineLR(optimizer(lrs=(0.01, 0.003)), total, min_ratio, steps, cos_min, kind))
    for g, base in enumerate((0.01, 0.003)):
        column = [row[g] for row in got]
        assert_close(column, [ref_cosine(n, base, total, min_ratio, steps, cos_min, kind) for n in range(STEPS + 1)])
        assert column[-1] == pytest.approx(base * cos_min, abs=1e-15)  # stays at the floor past the end


@pytest.mark.parametrize("staircase", [False, True])
@pytest.mark.parametrize("size, rate", [(7, 1.0), (50, 0.3)])
def test_lr_range_test(staircase, size, rate):
    got = trace(LRRangeTest(optimizer(lrs=(0.1, 0.1)), [1e-4, 3e-4], size, rate, staircase))
    for g, low in enumerate((1e-4, 3e-4)):
        assert_close([row[g] for row in got], [ref_lrrt(n, low, size, rate, staircase) for n in range(STEPS + 1)])
    if staircase:  # the rate changes only every `size` steps
        assert len({row[0] for row in got[:size]}) == 1 and got[size][0] > got[size - 1][0]


ONE_CYCLE_CASES = {
    "symmetric": dict(cycle_first_step_size=50),
    "asymmetric": dict(cycle_first_step_size=30, cycle_second_step_size=70),
    "stairs": dict(cycle_first_step_size=40, cycle_first_stair_count=8, cycle_second_step_size=60,
                   cycle_second_stair_count=5),
    "stairs_second_defaults_to_first": dict(cycle_first_step_size=60, cycle_first_stair_count=6),
    "decay": dict(cycle_first_step_size=50, decay_step_size=20, decay_lr_rate=0.5, decay_mom_rate=0.01),
}


def _onecycle_ref(params, n):
    return ref_onecycle(n, 1e-4, 1e-3, params["cycle_first_step_size"], params.get("cycle_second_step_size"),
                        params.get("cycle_first_stair_count", 0), params.get("cycle_second_stair_count"),
                        params.get("decay_step_size", 0), params.get("decay_lr_rate", 0.0), (0.85, 0.95),
                        params.get("decay_mom_rate", 0.0))


@pytest.mark.parametrize("kind", ["adam", "sgd"])
@pytest.mark.parametrize("case", list(ONE_CYCLE_CASES))
def test_one_cycle_rate_and_momentum(case, kind):
    params = ONE_CYCLE_CASES[case]
    opt = optimizer(kind, lrs=(0.5, 0.5))
    sgd_momentum = [group.get("momentum") for group in opt.param_groups]
    schedule = OneCycle(opt, 1e-4, 1e-3, cycle_min_mom=0.85, cycle_max_mom=0.95, **params)
    lrs, moms = [], []
    for n in range(STEPS + 1):
        if n:
            schedule.step()
        for group in opt.param_groups:  # DeepSpeed writes betas = (momentum, 0.99); SGD's momentum is not cycled
            assert (group["betas"][1] == 0.99) if kind == "adam" else ("betas" not in group)
        lrs.append(opt.param_groups[1]["lr"])
        moms.append(opt.param_groups[1]["betas"][0] if kind == "adam" else opt.param_groups[1]["momentum"])
    want = [_onecycle_ref(params, n) for n in range(STEPS + 1)]
    assert_close(lrs, [w[0] for w in want], "lr")
    if kind == "adam":  # at construction DeepSpeed sets the cycle's lowest momentum, then follows the cycle
        assert_close(moms, [0.85] + [w[1] for w in want[1:]], "momentum")
    else:
        assert moms == [sgd_momentum[1]] * (STEPS + 1)
    if "stair" in case:
        assert len(set(lrs[:80])) < 30  # really a staircase


def test_one_cycle_without_momentum_cycling_leaves_the_momentum_alone():
    opt = optimizer("adagrad")  # no betas, no momentum: fine when momentum is not cycled
    schedule = OneCycle(opt, 0.1, 0.2, cycle_first_step_size=5, cycle_momentum=False)
    assert schedule.get_mom() is None
    adam = optimizer("adam", betas=(0.7, 0.8))
    schedule = OneCycle(adam, 0.1, 0.2, cycle_first_step_size=5, cycle_momentum=False)
    trace(schedule, 20)
    assert adam.param_groups[0]["betas"] == (0.7, 0.8)


# ---- construction, resumption, explicit iterations ----

FACTORIES = {
    "WarmupLR": (lambda o, it=-1: WarmupLR(o, 1e-4, 1e-3, 30, "linear", last_batch_iteration=it), 1e-4),
    "WarmupDecayLR": (lambda o, it=-1: WarmupDecayLR(o, 200, 2e-4, 1e-3, 30, last_batch_iteration=it), 2e-4),
    "WarmupCosineLR": (lambda o, it=-1: WarmupCosineLR(o, 200, 0.2, 30, last_batch_iteration=it), 0.2 * 0.01),
    "OneCycle": (lambda o, it=-1: OneCycle(o, 1e-4, 1e-3, cycle_first_step_size=40, decay_step_size=10,
                                           decay_lr_rate=0.1, last_batch_iteration=it), 1e-4),
    "LRRangeTest": (lambda o, it=-1: LRRangeTest(o, 3e-4, 10, 0.5, True, last_batch_iteration=it), 3e-4),
}


@pytest.mark.parametrize("name", list(FACTORIES))
def test_the_rate_at_construction_and_when_resuming(name):
    make, at_start = FACTORIES[name]
    opt = optimizer(lrs=(0.01, 0.01))
    schedule = make(opt)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([at_start] * 2)
    assert schedule.get_last_lr() == pytest.approx([at_start] * 2)
    resumed_opt = optimizer(lrs=(0.01, 0.01))
    resumed = make(resumed_opt, 7)  # resuming: the optimizer is left as it is until the next step
    assert [g["lr"] for g in resumed_opt.param_groups] == [0.01, 0.01]
    with pytest.raises(RuntimeError, match="no learning rate set yet"):
        resumed.get_last_lr()
    fresh = make(optimizer(lrs=(0.01, 0.01)))
    for _ in range(9):
        fresh.step()
    resumed.step()  # iteration 8, as the fresh one after 9 steps
    assert resumed.get_last_lr() == pytest.approx(fresh.get_last_lr())


@pytest.mark.parametrize("name", list(FACTORIES))
def test_state_dict_round_trip_resumes_identically(name):
    make, _ = FACTORIES[name]
    opt_a = optimizer()
    a = make(opt_a)
    for _ in range(123):
        a.step()
    state = json.loads(json.dumps(a.state_dict()))  # what a checkpoint holds survives JSON
    assert state == {"last_batch_iteration": 122}
    opt_b = optimizer()
    b = make(opt_b)
    b.load_state_dict(state)
    for _ in range(150):
        a.step()
        b.step()
        assert opt_b.param_groups[0]["lr"] == opt_a.param_groups[0]["lr"]
        assert opt_b.param_groups[0]["betas"] == opt_a.param_groups[0]["betas"]
    assert a.last_batch_iteration == b.last_batch_iteration == 272


def test_step_jumps_to_an_explicit_iteration():
    schedule = WarmupDecayLR(optimizer(), 100, 0.0, 1e-3, 10, "linear")
    schedule.step(last_batch_iteration=55)
    assert schedule.get_last_lr() == pytest.approx([ref_warmup(56, 0.0, 1e-3, 10, "linear", 100)])
    cycle = OneCycle(optimizer(), 0.1, 0.3, cycle_first_step_size=10)
    cycle.step(batch_iteration=4)
    assert cycle.get_last_lr() == pytest.approx([0.1 + 0.2 * 0.5])
    cycle.step()
    assert cycle.last_batch_iteration == 5


def test_a_tensor_learning_rate_stays_a_tensor():
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([param], lr=torch.tensor(0.01))
    schedule = WarmupLR(opt, 0.0, 1e-3, 10, "linear")
    for _ in range(6):
        schedule.step()
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(5e-4)


def test_a_wrapper_holding_an_optimizer_is_accepted():
    class Wrapper:
        def __init__(self, inner):
            self.optimizer = inner

    inner = optimizer()
    WarmupLR(Wrapper(inner), 0.25, 0.5)
    assert inner.param_groups[0]["lr"] == 0.25


# ---- the config path ----

def test_build_scheduler_from_the_shared_configs():
    built = {}
    for path in sorted(CONFIGS.glob("*.json")):
        whole = json.loads(path.read_text())
        opt = optimizer(betas=(0.9, 0.999), lrs=(whole.get("optimizer", {}).get("params", {}).get("lr", 1e-3),))
        schedule = build_scheduler(path, opt)
        if "scheduler" not in whole:
            assert schedule is None, path.name
            continue
        section = whole["scheduler"]
        assert type(schedule).__name__ == section["type"]
        assert type(build_scheduler(section, optimizer())) is type(schedule)  # the section alone
        assert type(build_scheduler(whole, optimizer())) is type(schedule)  # the whole dict
        p = section["params"]
        for n in range(1, 2101):
            schedule.step()
            if section["type"] == "WarmupLR":
                want = ref_warmup(n, p["warmup_min_lr"], p["warmup_max_lr"], p["warmup_num_steps"], "log")
            else:
                assert section["type"] == "OneCycle"  # pipeline_lr.json: the tutorial's 1-cycle with stairs
                want, mom = ref_onecycle(n, p["cycle_min_lr"], p["cycle_max_lr"], p["cycle_first_step_size"],
                                         p["cycle_second_step_size"], p["cycle_first_stair_count"],
                                         p["cycle_second_stair_count"], p["decay_step_size"], p["decay_lr_rate"],
                                         (p["cycle_min_mom"], p["cycle_max_mom"]), p["decay_mom_rate"])
                assert opt.param_groups[0]["betas"] == pytest.approx((mom, 0.99))  # DeepSpeed's beta2
            assert opt.param_groups[0]["lr"] == pytest.approx(want, rel=1e-12), (path.name, n)
        built[path.name] = section["type"]
    assert built == {"pipeline_lr.json": "OneCycle", "zero1_fp16.json": "WarmupLR", "zero3_nvme.json": "WarmupLR"}


def test_scheduler_config_keeps_what_was_written_and_builds_from_an_instance():
    section = {"type": "WarmupDecayLR", "params": {"total_num_steps": 1e3, "warmup_num_steps": 10}}
    config = SchedulerConfig.from_ds_config({"scheduler": section, "train_batch_size": 8})
    assert config.type == "WarmupDecayLR" and config.params == section["params"]
    schedule = build_scheduler(config, optimizer())
    assert isinstance(schedule, WarmupDecayLR) and schedule.total_num_steps == 1000
    assert SchedulerConfig().type is None and build_scheduler({}, optimizer()) is None


BAD_CONFIGS = [
    ({"type": "WarmupLr"}, r"scheduler\.type: unknown schedule 'WarmupLr'; did you mean 'WarmupLR'\? "
                           r"Allowed: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest"),
    ({"type": "onecycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 1}}, r"did you mean 'OneCycle'\?"),
    ({"type": "Noam"}, r"unknown schedule 'Noam' Allowed: WarmupLR"),  # nothing close: no suggestion
    ({"type": "WarmupLR", "params": {"warmup_max_lrr": 1e-3}},
     r"scheduler\.params\.warmup_max_lrr: unknown parameter 'warmup_max_lrr' of WarmupLR; did you mean "
     r"'warmup_max_lr'\? Allowed: warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration"),
    ({"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_max_lr": "auto"}},
     r"scheduler\.params\.total_num_steps: is 'auto'.*\nscheduler\.params\.warmup_max_lr: is 'auto'"),
    ({"type": "WarmupCosineLR", "params": {}}, r"scheduler\.params\.total_num_steps: is required by WarmupCosineLR"),
    ({"params": {"warmup_num_steps": 10}}, r"scheduler\.type: is required when params are given"),
    ({"type": "WarmupLR", "parms": {}}, r"unknown key 'parms'; did you mean 'params'\?"),
    ({"type": 3}, r"scheduler\.type: must be a string"),
]


@pytest.mark.parametrize("section, message", BAD_CONFIGS, ids=lambda v: str(v)[:40])
def test_bad_scheduler_sections_are_refused_by_key(section, message):
    with pytest.raises(ConfigError, match=message):
        build_scheduler(section, optimizer())
    with pytest.raises(ConfigError, match=message):
        build_scheduler({"scheduler": section, "optimizer": {"type": "Adam"}}, optimizer())


def test_a_misspelled_scheduler_section_is_not_ignored():
    with pytest.raises(ConfigError, match="unknown section 'schedular'; did you mean 'scheduler'"):
        build_scheduler({"schedular": {"type": "WarmupLR"}, "train_batch_size": 8}, optimizer())


# ---- bad arguments: a ValueError that names the parameter and what is allowed ----

BAD_ARGUMENTS = [
    (lambda o: WarmupLR(o, warmup_num_steps=-5), r"WarmupLR: warmup_num_steps must be an integer >= 0, got -5"),
    (lambda o: WarmupLR(o, warmup_num_steps=2.5), r"warmup_num_steps must be an integer >= 0, got 2\.5"),
    (lambda o: WarmupLR(o, 1e-2, 1e-3), r"warmup_min_lr \(0\.01\) must be <= warmup_max_lr \(0\.001\)"),
    (lambda o: WarmupLR(o, -1e-3), r"warmup_min_lr must be in \[0\.0, inf\], got -0\.001"),
    (lambda o: WarmupLR(o, [0.0, 0.1]), r"warmup_min_lr must be one number or a list of one per param group "
                                        r"\(1\), got a list of 2"),
    (lambda o: WarmupLR(o, "0.1"), r"warmup_min_lr must be a finite number, got '0\.1'"),
    (lambda o: WarmupLR(o, last_batch_iteration=-2), r"last_batch_iteration must be an integer >= -1, got -2"),
    (lambda o: WarmupDecayLR(o, -1), r"total_num_steps must be an integer >= 1, got -1"),
    (lambda o: WarmupCosineLR(o, 100, cos_min_ratio=1.5, warmup_num_steps=10),
     r"cos_min_ratio must be in \[0\.0, 1\.0\], got 1\.5"),
    (lambda o: WarmupCosineLR(o, 100, warmup_min_ratio=-0.1, warmup_num_steps=10),
     r"warmup_min_ratio must be in \[0\.0, 1\.0\]"),
    (lambda o: LRRangeTest(o, lr_range_test_step_size=0), r"lr_range_test_step_size must be an integer >= 1, got 0"),
    (lambda o: LRRangeTest(o, lr_range_test_step_rate=-1.0), r"lr_range_test_step_rate must be in \[0\.0, inf\]"),
    (lambda o: LRRangeTest(o, lr_range_test_staircase="yes"), r"lr_range_test_staircase must be true or false"),
    (lambda o: OneCycle(o, 1e-2, 1e-3), r"OneCycle: cycle_min_lr \(0\.01\) must be <= cycle_max_lr \(0\.001\)"),
    (lambda o: OneCycle(o, 1e-4, 1e-3, cycle_min_mom=0.95, cycle_max_mom=0.9),
     r"cycle_min_mom \(0\.95\) must be <= cycle_max_mom \(0\.9\)"),
    (lambda o: OneCycle(o, 1e-4, 1e-3, cycle_max_mom=1.2), r"cycle_max_mom must be in \[-inf, 1\.0\], got 1\.2"),
    (lambda o: OneCycle(o, 1e-4, 1e-3, cycle_first_step_size=0), r"cycle_first_step_size must be an integer >= 1"),
    (lambda o: OneCycle(o, 1e-4, 1e-3, cycle_second_step_size=-10), r"cycle_second_step_size must be an integer >= 0"),
    (lambda o: OneCycle(o, 1e-4, 1e-3, cycle_first_stair_count=-1), r"cycle_first_stair_count must be an integer >= 0"),
    (lambda o: OneCycle(o, 1e-4, 1e-3, cycle_second_stair_count=-2), r"cycle_second_stair_count must be an integer >= 0"),
    (lambda o: OneCycle(o, 1e-4, 1e-3, decay_step_size=-1), r"decay_step_size must be an integer >= 0"),
    (lambda o: OneCycle(o, 1e-4, 1e-3, decay_step_size=10, decay_lr_rate=-0.5), r"decay_lr_rate must be in \[0\.0, inf\]"),
    (lambda o: WarmupLR(torch.nn.Linear(2, 2)), r"optimizer must be a torch\.optim\.Optimizer or hold one as \.optimizer, got Linear"),
    (lambda o: WarmupLR(o).step(-3), r"the iteration given to step\(\) must be an integer >= 0, got -3"),
    (lambda o: WarmupLR(o).load_state_dict({}), r"load_state_dict: expected a dict with 'last_batch_iteration'"),
]


@pytest.mark.parametrize("make, message", BAD_ARGUMENTS, ids=lambda v: v if isinstance(v, str) else "")
def test_bad_arguments_raise_value_error_naming_them(make, message):
    opt = optimizer()
    before = [dict(g) for g in opt.param_groups]
    with pytest.raises(ValueError, match=message):
        make(opt)
    if "iteration given" not in message and "load_state_dict" not in message:
        assert [dict(g) for g in opt.param_groups] == before  # a refused schedule touched nothing


# ---- the public API and the README ----

def test_the_schedules_are_exported():
    names = ["LRRangeTest", "OneCycle", "SchedulerConfig", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR",
             "build_scheduler"]
    assert set(names) <= set(ds_all.__all__)
    # the classes, and DeepSpeed's module constants (upper case: VALID_LR_SCHEDULES, WARMUP_TYPE, ...)
    assert sorted(n for n in ds_all.lr_schedules.__all__ if not n.isupper()) == sorted(n for n in names if n[0] in "LOW")
    for name in names:
        assert getattr(ds_all, name) is not None


def _readme_block() -> str:
    text = README.read_text().split("## Learning-rate schedules", 1)[1]
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def test_readme_example_runs_and_prints_what_it_says():
    block = _readme_block()
    assert len(block.strip().splitlines()) <= 14
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, str(README), "exec", dont_inherit=True), {})
    promised = re.search(r"# (\S+):", block.splitlines()[-1]).group(1)
    assert out.getvalue().strip() == promised == "1.0e-07"
    assert float(promised) == pytest.approx(1e-3 * 1e-4)  # cos_min_ratio's default times the lr


def test_readme_lists_every_parameter_that_differs():
    table = README.read_text().split("### Differences from DeepSpeed", 1)[1]
    for name in ("warmup_num_steps", "warmup_type", "total_num_steps", "cos_min_ratio", "decay_step_size",
                 "cycle_first_stair_count", "cycle_momentum", "lr_range_test_step_rate", "auto"):
        assert name in table, name
