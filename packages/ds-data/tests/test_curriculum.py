"""CurriculumScheduler against DeepSpeed's formulas, written out here as closed forms, at every step."""

from __future__ import annotations

import json
import logging
import math

import pytest

from ds_data import CurriculumLearningConfig, CurriculumScheduler


def root_closed_form(t: int, low: int, high: int, total: int, step: int, degree: float) -> int:
    d = math.floor((float(t) / total) ** (1.0 / degree) * (high - low) + low)
    d = d - d % step
    first = math.ceil(low / step) * step
    return min(max(d, first), high)


def discrete_closed_form(t: int, difficulty: list[int], max_step: list[int]) -> int:
    for d, m in zip(difficulty, max_step, strict=False):
        if t <= m:
            return d
    return difficulty[-1]


def _config(schedule_type, low, high, **schedule):
    return {"min_difficulty": low, "max_difficulty": high, "schedule_type": schedule_type,
            "schedule_config": schedule}


ROOT_CASES = [  # (low, high, total, step, degree)
    (8, 1024, 100, 8, 1), (8, 1024, 100, 8, 2), (64, 2048, 1000, 16, 3), (8, 100, 50, 16, 1),
    (5, 77, 30, 4, 1.5), (0, 512, 7, 8, 2), (128, 128, 10, 8, 1),
]


@pytest.mark.parametrize(("low", "high", "total", "step", "degree"), ROOT_CASES)
def test_fixed_root_and_linear_equal_the_closed_form_at_every_step(low, high, total, step, degree):
    kind = "fixed_linear" if degree == 1 else "fixed_root"
    schedule = {"total_curriculum_step": total, "difficulty_step": step}
    if kind == "fixed_root":
        schedule["root_degree"] = degree
    scheduler = CurriculumScheduler(_config(kind, low, high, **schedule))
    assert scheduler.get_current_difficulty() == low
    current = low
    for t in range(0, 2 * total + 3):
        expected = root_closed_form(t, low, high, total, step, degree)
        assert scheduler.get_difficulty(t) == expected, t
        if current < high:
            current = expected
        assert scheduler.update_difficulty(t) == current == scheduler.get_current_difficulty(), t
    assert current == high


def test_values_deepspeed_0_19_8_gives():
    """Measured with DeepSpeed 0.19.8's CurriculumScheduler (update_difficulty at these steps)."""
    steps = (0, 1, 2, 3, 5, 6, 10, 11, 25, 49, 50, 60, 99, 100, 101)
    cases = {
        (8, 1024, "fixed_linear", 100, 8, None): [8, 16, 24, 32, 56, 64, 104, 112, 256, 504, 512, 616, 1008, 1024, 1024],
        (8, 1024, "fixed_root", 100, 8, 2): [8, 104, 144, 176, 232, 256, 328, 344, 512, 712, 720, 792, 1016, 1024, 1024],
        (8, 100, "fixed_linear", 50, 16, None): [16, 16, 16, 16, 16, 16, 16, 16, 48, 96, 96, 100, 100, 100, 100],
    }
    for (low, high, kind, total, step, degree), values in cases.items():
        schedule = {"total_curriculum_step": total, "difficulty_step": step}
        if degree is not None:
            schedule["root_degree"] = degree
        scheduler = CurriculumScheduler(_config(kind, low, high, **schedule))
        assert [scheduler.update_difficulty(t) for t in steps] == values
    discrete = CurriculumScheduler(_config("fixed_discrete", 1, 3, difficulty=[1, 2, 3], max_step=[5, 10]))
    assert [discrete.update_difficulty(t) for t in steps] == [1, 1, 1, 1, 1, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3]


@pytest.mark.parametrize(("difficulty", "max_step"), [([1, 2, 3], [5, 10]), ([16, 64, 32, 128], [0, 3, 9]), ([7], [])])
def test_fixed_discrete_equals_the_closed_form_at_every_step(difficulty, max_step):
    if not max_step:
        with pytest.raises(ValueError, match="max_step must not be empty"):
            CurriculumScheduler(_config("fixed_discrete", 7, 7, difficulty=difficulty, max_step=max_step))
        return
    high = max(difficulty)
    scheduler = CurriculumScheduler(_config("fixed_discrete", min(difficulty), high, difficulty=difficulty,
                                            max_step=max_step))
    current = min(difficulty)
    for t in range(0, max_step[-1] + 5):
        expected = discrete_closed_form(t, difficulty, max_step)
        assert scheduler.get_difficulty(t) == expected
        if current < high:
            current = expected
        assert scheduler.update_difficulty(t) == current


def test_custom_schedule_and_its_missing_function():
    scheduler = CurriculumScheduler({"min_difficulty": 2, "max_difficulty": 51, "schedule_type": "custom"})
    with pytest.raises(RuntimeError, match="set_custom_get_difficulty"):
        scheduler.update_difficulty(1)
    with pytest.raises(ValueError, match="callable"):
        scheduler.set_custom_get_difficulty(3)
    scheduler.set_custom_get_difficulty(lambda t: 2 + 3 * t)
    current = 2
    for t in range(20):
        if current < 51:  # moved while below max; a custom value is not capped (53 at t=17 stays)
            current = 2 + 3 * t
        assert scheduler.update_difficulty(t) == current
    assert current == 53
    assert scheduler.get_difficulty(100) == 302  # get_difficulty is the function, uncapped


def test_set_current_difficulty_and_state_round_trip():
    config = _config("fixed_root", 8, 256, total_curriculum_step=40, difficulty_step=8, root_degree=2)
    a = CurriculumScheduler(config)
    for t in range(13):
        a.update_difficulty(t)
    state = json.loads(json.dumps(a.state_dict()))  # JSON values only
    assert state["current_difficulty"] == root_closed_form(12, 8, 256, 40, 8, 2)
    b = CurriculumScheduler(_config("fixed_linear", 1, 2, total_curriculum_step=1, difficulty_step=1))
    b.load_state_dict(state)
    assert b.state_dict() == a.state_dict() and b.get_current_difficulty() == a.get_current_difficulty()
    for t in range(13, 60):
        assert a.update_difficulty(t) == b.update_difficulty(t)
    b.set_current_difficulty(16)
    assert b.get_current_difficulty() == 16 and b.get_state()["current_difficulty"] == 16
    with pytest.raises(ValueError, match="integer"):
        b.set_current_difficulty(1.5)
    with pytest.raises(ValueError, match="keys"):
        b.load_state_dict({"current_difficulty": 3})
    bad = dict(state, schedule_type="fixed_cubic")
    with pytest.raises(ValueError, match="fixed_cubic"):
        b.load_state_dict(bad)


def test_difficulty_step_not_a_multiple_of_8_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="ds_data"):
        CurriculumScheduler(_config("fixed_linear", 8, 64, total_curriculum_step=10, difficulty_step=8))
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="ds_data"):
        CurriculumScheduler(_config("fixed_linear", 8, 64, total_curriculum_step=10, difficulty_step=12))
    assert len(caplog.records) == 1 and "difficulty_step 12 is not a multiple of 8" in caplog.records[0].getMessage()


@pytest.mark.parametrize(("config", "words"), [
    (_config("linear", 8, 64), "schedule_type must be one of 'fixed_linear', 'fixed_root', 'fixed_discrete', "
                               "'custom', got 'linear'"),
    (_config("fixed_root", 8, 64, total_curriculum_step=10, difficulty_step=8),
     "needs schedule_config.root_degree (schedule_type 'fixed_root' needs them)"),
    (_config("fixed_linear", 8, 64, difficulty_step=8), "needs schedule_config.total_curriculum_step"),
    (_config("fixed_discrete", 1, 3, difficulty=[1, 2, 3], max_step=[5]),
     "difficulty must have one more entry than max_step"),
    (_config("fixed_discrete", 1, 3, difficulty=[1, 2, 3]), "needs schedule_config.max_step"),
    (_config("fixed_discrete", 1, 3, difficulty=[1, 2, 3], max_step=[5, 5]), "max_step must be increasing"),
    (_config("fixed_linear", 64, 8, total_curriculum_step=10, difficulty_step=8),
     "min_difficulty 64 is above max_difficulty 8"),
    (_config("fixed_linear", 8, 64, total_curriculum_step=0, difficulty_step=8),
     "total_curriculum_step must be a positive integer, got 0"),
    (_config("fixed_linear", 8, 64, total_curriculum_step=10, difficulty_step=0),
     "difficulty_step must be a positive integer, got 0"),
    (_config("fixed_root", 8, 64, total_curriculum_step=10, difficulty_step=8, root_degree=-2),
     "root_degree must be a number > 0, got -2"),
    (_config("fixed_linear", -1, 64, total_curriculum_step=10, difficulty_step=8), "min_difficulty must be >= 0"),
    (_config("fixed_linear", 8, 64, total_curriculum_step=10, difficulty_stp=8), "did you mean 'difficulty_step'"),
    ({"max_difficulty": 64, "schedule_type": "custom"}, "needs min_difficulty"),
    ({**_config("fixed_linear", 8, 64, total_curriculum_step=10, difficulty_step=8), "curriculum_type": "vocab"},
     "curriculum_type must be one of 'seqlen', got 'vocab'"),
])
def test_bad_values_are_named(config, words):
    with pytest.raises(ValueError) as error:
        CurriculumScheduler(config)
    assert words in str(error.value)


def test_the_section_is_checked_only_for_completeness_when_enabled():
    off = CurriculumLearningConfig.from_ds_config({"curriculum_learning": {"enabled": False}})
    assert off.enabled is False and off.params() == {"curriculum_type": "seqlen", "schedule_config": {}}
    with pytest.raises(ValueError, match="curriculum_learning needs min_difficulty, max_difficulty, schedule_type"):
        CurriculumLearningConfig.from_ds_config({"curriculum_learning": {"enabled": True}})
    with pytest.raises(ValueError, match="min_difficulty 9 is above max_difficulty 3"):
        CurriculumLearningConfig(min_difficulty=9, max_difficulty=3)  # named even while off
    on = CurriculumLearningConfig.from_ds_config({"curriculum_learning": {
        "enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8, "max_difficulty": 1024,
        "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 15000, "difficulty_step": 8}}})
    assert on.params() == {"curriculum_type": "seqlen", "min_difficulty": 8, "max_difficulty": 1024,
                           "schedule_type": "fixed_linear",
                           "schedule_config": {"total_curriculum_step": 15000, "difficulty_step": 8}}
    assert CurriculumScheduler(on).get_difficulty(7500) == root_closed_form(7500, 8, 1024, 15000, 8, 1)
    with pytest.raises(ValueError, match="did you mean 'curriculum_learning'"):
        CurriculumLearningConfig.from_ds_config({"curriculum_learnin": {"enabled": True}})
