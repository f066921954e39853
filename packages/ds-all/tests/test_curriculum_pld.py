"""The engine's wiring of ds-data (the top-level curriculum_learning section and progressive_layer_drop): the
keyword arguments the model's forward gets at each step, against DeepSpeed's formulas written out here; the
state in checkpoints; the sections in the config."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import ds_all
from ds_all import Config
from ds_comm.testing import spawn

LOW, HIGH, TOTAL, STEP = 2, 16, 6, 2  # the curriculum: fixed_linear from 2 to 16 over 6 steps, multiples of 2
THETA, GAMMA = 0.5, 0.1
GAS, SAVE_AT, STEPS = 2, 4, 8


def _config(**extra):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS, "steps_per_print": 100,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
            "curriculum_learning": {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": LOW,
                                    "max_difficulty": HIGH, "schedule_type": "fixed_linear",
                                    "schedule_config": {"total_curriculum_step": TOTAL, "difficulty_step": STEP}},
            "progressive_layer_drop": {"enabled": True, "theta": THETA, "gamma": GAMMA}, **extra}


def expected_seqlen(global_steps: int) -> int:
    """DeepSpeed: forward calls update_difficulty(global_steps + 1); fixed_linear's closed form, latched at max."""
    current = LOW
    for g in range(global_steps + 1):
        if current < HIGH:
            d = math.floor((g + 1) / TOTAL * (HIGH - LOW) + LOW)
            current = min(max(d - d % STEP, math.ceil(LOW / STEP) * STEP), HIGH)
    return current


def expected_theta(global_steps: int) -> float:
    """DeepSpeed: theta is 1.0 until the first step's update_state(0); after step g, update_state(g)."""
    if global_steps == 0:
        return 1.0
    return float((1.0 - THETA) * np.exp(-GAMMA * (global_steps - 1)) + THETA)


class Recorder(nn.Module):
    """A model whose forward takes DeepSpeed's keyword arguments and uses curriculum_seqlen to truncate."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 1)
        self.seen: list[tuple] = []

    def forward(self, x, curriculum_seqlen=None, progressive_layer_drop=None, pld_theta=None):
        self.seen.append((curriculum_seqlen, progressive_layer_drop, pld_theta))
        if curriculum_seqlen is not None:
            x = x[:, :curriculum_seqlen]
        return self.lin(x).mean()


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(2, HIGH, 4, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(engine, rank: int, until: int) -> list[tuple]:
    """Micro-steps until ``until`` optimizer steps; (global_steps at the forward, what the forward got)."""
    out = []
    while engine.global_steps < until:
        before = engine.global_steps
        loss = engine(_batch(engine.micro_steps, rank))
        out.append((before, engine.module.seen[-1]))
        engine.backward(loss)
        engine.step()
    return out


def first_run(rank, world_size, path):
    engine, *_ = ds_all.initialize(model=Recorder(), config=_config())
    assert engine.curriculum_enabled_legacy() and engine.pld_enabled()
    assert engine.get_pld_theta() == 1.0 and engine.curriculum_scheduler_legacy.get_current_difficulty() == LOW
    seen = _train(engine, rank, SAVE_AT)
    engine.save_checkpoint(path)
    saved = (engine.curriculum_scheduler_legacy.get_current_difficulty(), engine.get_pld_theta())
    seen_after = _train(engine, rank, STEPS)
    engine.eval()
    engine(_batch(0, rank))  # evaluation: nothing added
    evaluated = engine.module.seen[-1]
    getters = (engine.curriculum_params_legacy(), engine.pld_params(), engine.pld_theta(), engine.pld_gamma())
    engine.destroy()
    return seen, saved, seen_after, evaluated, getters


def resumed_run(rank, world_size, path):
    engine, *_ = ds_all.initialize(model=Recorder(), config=_config())
    engine.load_checkpoint(path)
    restored = (engine.global_steps, engine.curriculum_scheduler_legacy.get_current_difficulty(),
                engine.get_pld_theta())  # before any forward: from the checkpoint, not recomputed
    seen = _train(engine, rank, STEPS)
    engine.destroy()
    return restored, seen


def test_forward_gets_curriculum_seqlen_and_pld_theta_at_each_step_and_a_checkpoint_restores_them(tmp_path):
    path = str(tmp_path / "ck")
    first = spawn(first_run, world_size=2, args=(path,))
    second = spawn(resumed_run, world_size=2, args=(path,))
    for (seen, saved, seen_after, evaluated, getters), (restored, resumed) in zip(first, second, strict=True):
        assert len(seen) == SAVE_AT * GAS and len(seen_after) == (STEPS - SAVE_AT) * GAS
        for global_steps, got in seen + seen_after:
            assert got == (expected_seqlen(global_steps), True, expected_theta(global_steps)), global_steps
        assert [got[0] for _, got in seen + seen_after][::GAS] == [4, 6, 8, 10, 12, 16, 16, 16]
        assert saved == (expected_seqlen(SAVE_AT - 1), float((1 - THETA) * np.exp(-GAMMA * (SAVE_AT - 1)) + THETA))
        assert evaluated == (None, None, None)
        assert getters == ({"curriculum_type": "seqlen", "min_difficulty": LOW, "max_difficulty": HIGH,
                            "schedule_type": "fixed_linear",
                            "schedule_config": {"total_curriculum_step": TOTAL, "difficulty_step": STEP}},
                           {"theta": THETA, "gamma": GAMMA}, THETA, GAMMA)
        assert restored == (SAVE_AT, *saved)
        assert resumed == seen_after


def test_the_sections_load_and_a_misspelled_key_is_named():
    config = Config.load({"train_batch_size": 4, **{k: v for k, v in _config().items() if k not in (
        "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")}})
    assert config.curriculum_learning.enabled and config.curriculum_learning.schedule_config.total_curriculum_step \
        == TOTAL
    assert (config.progressive_layer_drop.theta, config.progressive_layer_drop.gamma) == (THETA, GAMMA)
    off = Config.load({"train_batch_size": 4})
    assert not off.curriculum_learning.enabled and not off.progressive_layer_drop.enabled
    bad = _config()
    bad["curriculum_learning"] = {**bad["curriculum_learning"], "schedule_config": {"total_curriculum_steps": 6,
                                                                                    "difficulty_step": 2}}
    with pytest.raises(ValueError) as error:
        Config.load(bad)
    assert "curriculum_learning.schedule_config.total_curriculum_steps" in str(error.value)
    assert "did you mean 'total_curriculum_step'" in str(error.value)
    with pytest.raises(ValueError, match=r"progressive_layer_drop\.gama.*did you mean 'gamma'"):
        Config.load({"train_batch_size": 4, "progressive_layer_drop": {"enabled": True, "gama": 0.1}})
    with pytest.raises(ValueError, match=r"curriculum_learning\.schedule_type must be one of"):
        Config.load({"train_batch_size": 4, "curriculum_learning": {
            "enabled": True, "min_difficulty": 8, "max_difficulty": 64, "schedule_type": "linear"}})


def pipeline_run(rank, world_size):
    import torch.nn.functional as F

    from ds_pipe import LayerSpec, PipelineModule

    def module():
        return PipelineModule([LayerSpec(nn.Linear, 4, 4), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 4, 1)],
                              num_stages=2, loss_fn=F.mse_loss, partition_method="uniform")

    config = {k: v for k, v in _config().items() if k != "progressive_layer_drop"}
    engine, *_ = ds_all.initialize(model=module(), config=config)
    difficulties = []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        engine.train_batch(iter([(torch.randn(2, 4, generator=g), torch.randn(2, 1, generator=g))] * GAS))
        difficulties.append(engine.curriculum_scheduler_legacy.get_current_difficulty())
    engine.destroy()
    try:
        ds_all.initialize(model=module(), config=_config())
    except NotImplementedError as e:
        return difficulties, str(e)
    return difficulties, None


def test_a_pipeline_moves_the_difficulty_each_batch_and_refuses_progressive_layer_drop():
    for difficulties, refusal in spawn(pipeline_run, world_size=2):
        assert difficulties == [expected_seqlen(g) for g in range(3)]
        assert refusal is not None and "progressive_layer_drop with a PipelineModule" in refusal


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return x + self.lin(x)


class Droppable(nn.Module):
    """A model whose blocks ds_data.ProgressiveLayerDropBlock may skip, counting the blocks that ran."""

    def __init__(self) -> None:
        super().__init__()
        from ds_data import ProgressiveLayerDropBlock

        torch.manual_seed(0)
        self.blocks = nn.ModuleList(ProgressiveLayerDropBlock(Residual(), i, 4) for i in range(4))
        self.head = nn.Linear(4, 1)
        self.ran = 0

    def forward(self, x, progressive_layer_drop=None, pld_theta=None):
        for block in self.blocks:
            y = block(x, pld_theta=pld_theta)
            self.ran += not torch.equal(y, x)
            x = y
        return self.head(x).square().mean()


def droppable_run(rank, world_size, stage):
    engine, *_ = ds_all.initialize(model=Droppable(), config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "progressive_layer_drop": {"enabled": True, "theta": 0.3, "gamma": 0.5}})
    torch.manual_seed(rank)  # the ranks skip different blocks
    for step in range(10):
        engine.backward(engine(_batch(step, rank)[:, 0]))
        engine.step()
    weights = [t.tolist() for t in engine.optimizer.full_state_dict(rank0_only=False).values()]
    ran = engine.module.ran
    engine.destroy()
    return weights, ran


@pytest.mark.parametrize("stage", [0, 2])
def test_droppable_blocks_train_under_zero_with_ranks_that_skip_different_blocks(stage):
    (weights_0, ran_0), (weights_1, ran_1) = spawn(droppable_run, world_size=2, args=(stage,))
    assert weights_0 == weights_1  # the replicas agree though their forwards differed
    assert 0 < ran_0 < 40 and 0 < ran_1 < 40  # some blocks were skipped, some ran
