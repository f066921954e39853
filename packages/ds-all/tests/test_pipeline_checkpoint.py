"""Checkpoints of a PipelineEngine: 2 stages x 2 data-parallel replicas under ZeRO-1 resume bit for bit in
new processes (a weight tied across the stages included); the same checkpoint loads into one stage on one
rank at ZeRO stage 0 (layers keep their global names, so the stage count may change) with every weight
as saved; a checkpoint of another model is named."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_comm.testing import RankFailed, spawn

D, ROWS, MICRO_BATCHES = 8, 3, 2


def layer_specs():
    from ds_pipe import LayerSpec, TiedLayerSpec
    return [TiedLayerSpec("io", nn.Linear, 6, 6), LayerSpec(nn.Linear, 6, D), LayerSpec(nn.Tanh),
            LayerSpec(nn.Linear, D, 6), TiedLayerSpec("io", nn.Linear, 6, 6), LayerSpec(nn.Linear, 6, 2)]


def micro_batches(step: int, replica: int):
    g = torch.Generator().manual_seed(100 * step + replica)
    return [(torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 2, generator=g)) for _ in range(MICRO_BATCHES)]


def _engine(stages: int, zero_stage: int):
    import ds_all
    from ds_pipe import PipelineModule
    module = PipelineModule(layer_specs(), num_stages=stages, loss_fn=F.mse_loss, seed_layers=True,
                            partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": MICRO_BATCHES,
              "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "zero_optimization": {"stage": zero_stage},
              "steps_per_print": 1000}
    engine, *_ = ds_all.initialize(model=module, config=config)
    return engine, module


def _weights(module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def _train(engine, module, steps: range) -> list[float]:
    replica = module.mpu().get_data_parallel_rank()
    return [float(engine.train_batch(iter(micro_batches(step, replica)))) for step in steps]


def save_midway(rank, world, path):
    """3 steps, a checkpoint, 3 more: the uninterrupted run (saving changes nothing)."""
    engine, module = _engine(stages=2, zero_stage=1)
    _train(engine, module, range(3))
    engine.save_checkpoint(path)
    saved = _weights(module)
    losses = _train(engine, module, range(3, 6))
    return saved, _weights(module), losses


def resume(rank, world, path):
    engine, module = _engine(stages=2, zero_stage=1)
    load_path, _ = engine.load_checkpoint(path)
    assert engine.global_steps == 3, engine.global_steps
    losses = _train(engine, module, range(3, 6))
    return _weights(module), losses, load_path


def load_on_one_stage(rank, world, path):
    engine, module = _engine(stages=1, zero_stage=0)
    try:
        engine.load_checkpoint(path)
        refused = None
    except ValueError as e:  # stage 1's copy of the tied module's bias has no place in one stage
        refused = str(e)
    engine.load_checkpoint(path, load_module_strict=False)
    loaded = _weights(module)
    _train(engine, module, range(3, 4))
    return loaded, refused


def test_a_pipeline_resumes_bit_for_bit_and_loads_into_another_stage_count(tmp_path):
    path = str(tmp_path / "ck")
    first = spawn(save_midway, world_size=4, args=(path,), timeout=240)
    second = spawn(resume, world_size=4, args=(path,), timeout=240)
    for rank in range(4):
        _, straight, straight_losses = first[rank]
        resumed, resumed_losses, load_path = second[rank]
        assert load_path.endswith("global_step3")
        assert resumed_losses == straight_losses, rank  # the same floats
        assert straight.keys() == resumed.keys() and straight, rank
        for name in straight:
            assert torch.equal(straight[name], resumed[name]), (rank, name)
    # the tied weight lives on both stages and was written once; the tied module's bias is not tied, so
    # stage 1's copy is its own entry, named after stage 1's layer of it
    meta = json.loads((tmp_path / "ck" / "global_step3" / "zero_meta.json").read_text())
    assert meta["names"].count("tied_modules.io.weight") == 1
    assert sorted(meta["names"]) == sorted({n for r in range(4) for n in first[r][0]} | {"tied_modules.io[4].bias"})
    # one stage on one rank, ZeRO stage 0: every weight as saved (each from the stage that held it; the
    # tied module's from stage 0), once the extra copy is allowed to stay behind
    ((loaded, refused),) = spawn(load_on_one_stage, world_size=1, args=(path,))
    assert "not in the model: tied_modules.io[4].bias" in refused and "load_module_strict=False" in refused
    saved = {name: w for rank in reversed(range(4)) for name, w in first[rank][0].items()}
    assert loaded.keys() == saved.keys()
    for name, weight in saved.items():
        assert torch.equal(loaded[name], weight), name


def load_another_model(rank, world, path):
    import ds_all
    from ds_pipe import LayerSpec, PipelineModule
    specs = layer_specs()
    specs[1] = LayerSpec(nn.Linear, 6, D + 1)  # another width
    specs[3] = LayerSpec(nn.Linear, D + 1, 6)
    module = PipelineModule(specs, num_stages=2, loss_fn=F.mse_loss, partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": MICRO_BATCHES,
              "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "steps_per_print": 1000}
    engine, *_ = ds_all.initialize(model=module, config=config)
    engine.load_checkpoint(path)


def save_two_stages(rank, world, path):
    engine, module = _engine(stages=2, zero_stage=0)
    _train(engine, module, range(1))
    engine.save_checkpoint(path)


def test_a_pipeline_checkpoint_of_another_model_is_named(tmp_path):
    path = str(tmp_path / "ck")
    spawn(save_two_stages, world_size=2, args=(path,))
    with pytest.raises(RankFailed, match=r"another model .*other shapes: [13]\.weight: saved \[\d+, \d+\], model"):
        spawn(load_another_model, world_size=2, args=(path,))
