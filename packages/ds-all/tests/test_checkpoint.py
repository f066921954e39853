"""engine.save_checkpoint / load_checkpoint: a run resumed from its checkpoint in new processes
continues bit for bit (weights, schedule, data loader position, random state, client state); a
checkpoint of 2 ranks at stage 2 loads on 1 rank at stage 1 and trains on; an interrupted save is never
loaded and never named by ``latest``; bad tags and missing checkpoints are named."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import ds_all
from ds_comm.testing import RankFailed, spawn

SAVE_AT, STEPS = 3, 6


def _config(stage: int, nvme: str | None = None, **extra) -> dict:
    """``nvme``: ZeRO-Infinity's directory (stage 3: the optimizer's states and the parameters in files)."""
    infinity = {"sub_group_size": 100, "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
                "offload_param": {"device": "nvme", "nvme_path": nvme}} if nvme else {}
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 4,
                                                         "warmup_type": "linear"}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, **infinity,
                                  **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}, **extra}


def _data() -> torch.utils.data.Dataset:
    g = torch.Generator().manual_seed(7)
    return torch.utils.data.TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g))


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.Tanh(), nn.Linear(16, 1))


def _train(engine, batches, until: int) -> list[float]:
    """Micro-steps until ``until`` optimizer steps, drawing exactly the batches trained on."""
    losses = []
    while engine.global_steps < until:
        x, y = next(batches)
        loss = nn.functional.mse_loss(engine(x), y)  # dropout: the random state matters too
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def first_run(rank, world_size, path, stage, async_save=False, nvme=None):
    engine, _, loader, _ = ds_all.initialize(model=_model(), config=_config(stage, nvme), training_data=_data())
    batches = iter(loader)
    _train(engine, batches, SAVE_AT)
    engine.save_checkpoint(path, client_state={"epoch": 3, "note": "hi", "ema": torch.arange(3.0)},
                           async_save=async_save)
    losses = _train(engine, batches, STEPS)  # the same pass goes on (async: while the save is written)
    engine.destroy()  # stage 3: the parameters whole again; an asynchronous save finished
    weights = [p.detach().clone().tolist() for p in engine.module.parameters()]
    return losses, weights


def resumed_run(rank, world_size, path, stage, nvme=None):
    engine, _, loader, _ = ds_all.initialize(model=_model(seed=99), config=_config(stage, nvme),
                                             training_data=_data())
    loaded, client = engine.load_checkpoint(path)
    assert engine.global_steps == SAVE_AT
    losses = _train(engine, iter(loader), STEPS)  # the pass resumes where the checkpoint left it
    lr = engine.get_lr()
    engine.destroy()
    weights = [p.detach().clone().tolist() for p in engine.module.parameters()]
    return losses, weights, os.path.basename(loaded), {**client, "ema": client["ema"].tolist()}, lr


@pytest.mark.parametrize("stage, async_save, infinity", [(0, False, False), (2, False, False), (3, False, False),
                                                         (2, True, False), (3, True, True)])
def test_a_resumed_run_continues_bit_for_bit(tmp_path, stage, async_save, infinity):
    """async_save: the checkpoint holds the state at the call, though training went on while it was written
    (with ZeRO-Infinity, whose states are on NVMe, the save is synchronous)."""
    path, nvme = str(tmp_path / "ck"), str(tmp_path / "nvme") if infinity else None
    first = spawn(first_run, world_size=2, args=(path, stage, async_save, nvme))
    second = spawn(resumed_run, world_size=2, args=(path, stage, nvme))
    for (losses, weights), (resumed_losses, resumed_weights, tag, client, lr) in zip(first, second, strict=True):
        assert resumed_losses == losses and len(losses) == (STEPS - SAVE_AT) * 2
        assert resumed_weights == weights
        assert tag == f"global_step{SAVE_AT}"
        assert client == {"epoch": 3, "note": "hi", "ema": [0.0, 1.0, 2.0]}
        assert lr == [1e-2]  # WarmupLR past its 4 warmup steps, as in the uninterrupted run
    assert (tmp_path / "ck" / "latest").read_text() == f"global_step{SAVE_AT}"
    assert not [p for p in (tmp_path / "ck").iterdir() if p.name.startswith(".")]  # no partial left behind


def save_on_two(rank, world_size, path):
    engine, _, loader, _ = ds_all.initialize(model=_model(), config=_config(2), training_data=_data())
    _train(engine, iter(loader), SAVE_AT)
    engine.save_checkpoint(path, tag="two_ranks")
    weights = [p.detach().clone().tolist() for p in engine.module.parameters()]
    engine.destroy()
    return weights


def load_on_one(rank, world_size, path):
    config = _config(1, train_micro_batch_size_per_gpu=4)
    engine, _, loader, _ = ds_all.initialize(model=_model(seed=5), config=config, training_data=_data())
    engine.load_checkpoint(path, tag="two_ranks")
    weights = [p.detach().clone().tolist() for p in engine.module.parameters()]
    steps = engine.global_steps
    losses = _train(engine, iter(loader), SAVE_AT + 2)
    engine.destroy()
    return weights, steps, losses


def test_a_checkpoint_of_two_ranks_at_stage_2_loads_on_one_rank_at_stage_1(tmp_path):
    path = str(tmp_path / "ck")
    saved = spawn(save_on_two, world_size=2, args=(path,))[0]
    ((weights, steps, losses),) = spawn(load_on_one, world_size=1, args=(path,))
    assert weights == saved and steps == SAVE_AT
    assert len(losses) == 4 and all(loss == loss for loss in losses)


def refusals(rank, world_size, path):
    engine, *_ = ds_all.initialize(model=_model(), config=_config(1))
    out = {"nothing": engine.load_checkpoint(path)}
    for name, call, error in (
        ("bad tag", lambda: engine.save_checkpoint(path, tag="a/b"), ValueError),
        ("object in client state", lambda: engine.save_checkpoint(path, client_state={"f": object()}), ValueError),
        ("missing tag", lambda: engine.load_checkpoint(path, tag="nope"), FileNotFoundError),
    ):
        try:
            call()
            out[name] = "NOT REFUSED"
        except error as e:
            out[name] = str(e)
    engine.save_checkpoint(path, tag="good")
    if rank == 0:  # a save that died before its rename: the partial directory is reported, not loaded
        os.makedirs(os.path.join(path, ".broken.partial"))
    try:
        engine.load_checkpoint(path, tag="broken")
        out["partial"] = "NOT REFUSED"
    except FileNotFoundError as e:
        out["partial"] = str(e)
    engine.destroy()
    return out


def test_bad_tags_and_missing_or_partial_checkpoints_are_named(tmp_path):
    out = spawn(refusals, world_size=2, args=(str(tmp_path / "ck"),))[0]
    assert out["nothing"] == (None, None)
    assert "checkpoint tag must be a non-empty name without '/'" in out["bad tag"]
    assert "client_state['f'] is a object: only JSON values" in out["object in client state"]
    assert "ck/nope is not a checkpoint (no engine_meta.json)" in out["missing tag"]
    assert "was never completed (its save was interrupted" in out["partial"]
    meta = json.loads((tmp_path / "ck" / "good" / "engine_meta.json").read_text())
    assert meta["world_size"] == 2 and meta["tag"] == "good"


class _Backbone(nn.Module):
    """A frozen "pretrained" layer and a trainable head (``grown`` adds a second head)."""

    def __init__(self, head_seed: int, grown: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Linear(8, 16).requires_grad_(False)
        torch.manual_seed(head_seed)
        self.head = nn.Linear(16, 1)
        self.extra = nn.Linear(16, 1) if grown else None

    def forward(self, x):
        h = torch.tanh(self.backbone(x))
        return self.head(h) + (self.extra(h) if self.extra is not None else 0)


def _state(module: nn.Module) -> dict[str, list]:
    return {name: t.detach().clone().tolist() for name, t in module.state_dict().items()}


def partial_saves_and_loads(rank, world_size, path):
    from ds_zero import SafeReader

    config = _config(2)
    engine, *_ = ds_all.initialize(model=_Backbone(head_seed=1), config=config)
    batches = iter([(torch.randn(2, 8), torch.randn(2, 1)) for _ in range(8)])
    _train(engine, batches, 2)
    saved = _state(engine.module)
    engine.save_checkpoint(path, tag="no_frozen", exclude_frozen_parameters=True)
    engine.save_checkpoint(path, tag="whole")
    keys = {tag: sorted(k for k in SafeReader(os.path.join(path, tag)).read_metadata().state_dict_metadata
                        if k.startswith(("module/", "master/"))) for tag in ("no_frozen", "whole")}
    engine.destroy()
    out = {"keys": keys}
    # the frozen backbone comes from the model itself ("pretrained"), the head from the checkpoint
    engine, *_ = ds_all.initialize(model=_Backbone(head_seed=2), config=config)
    engine.load_checkpoint(path, tag="no_frozen")
    out["no_frozen loads"] = _state(engine.module) == saved
    engine.destroy()
    # a grown model: strict refuses by name, load_module_strict=False loads what both have
    grown = _Backbone(head_seed=3, grown=True)
    fresh_extra = _state(grown.extra)
    engine, *_ = ds_all.initialize(model=grown, config=config)
    try:
        engine.load_checkpoint(path, tag="whole")
        out["strict"] = "NOT REFUSED"
    except ValueError as e:
        out["strict"] = str(e)
    engine.load_checkpoint(path, tag="whole", load_module_strict=False)
    loaded = _state(engine.module)
    out["non-strict shared"] = all(loaded[k] == v for k, v in saved.items())
    out["non-strict new kept"] = _state(engine.module.extra) == fresh_extra
    _train(engine, iter([(torch.randn(2, 8), torch.randn(2, 1)) for _ in range(4)]), 4)  # and trains on
    out["trains"] = engine.global_steps
    engine.destroy()
    return out


def test_exclude_frozen_parameters_and_load_module_strict(tmp_path):
    out = spawn(partial_saves_and_loads, world_size=2, args=(str(tmp_path / "ck"),))[0]
    assert "module/backbone.weight" in out["keys"]["whole"]
    assert not [k for k in out["keys"]["no_frozen"] if "backbone" in k]
    assert out["no_frozen loads"]
    assert "missing from the checkpoint: extra.weight, extra.bias" in out["strict"]
    assert "load_module_strict=False" in out["strict"]
    assert out["non-strict shared"] and out["non-strict new kept"]
    assert out["trains"] == 4


def async_save_that_fails(rank, world_size, path):
    import ds_zero._storage as storage

    engine, _, loader, _ = ds_all.initialize(model=_model(), config=_config(2), training_data=_data())
    batches = iter(loader)
    _train(engine, batches, 1)
    engine.save_checkpoint(path, async_save=True)
    engine.wait_checkpoint()
    _train(engine, batches, 2)
    write = storage.RawWriter.write_data

    def disk_full(self, plan, planner):
        if rank == 1:
            raise OSError(28, "No space left on device")
        return write(self, plan, planner)

    storage.RawWriter.write_data = disk_full
    engine.save_checkpoint(path, async_save=True)
    _train(engine, batches, 3)  # training goes on; the failure shows at the wait
    try:
        engine.wait_checkpoint()
        message = None
    except RuntimeError as e:
        message = str(e)
    storage.RawWriter.write_data = write
    loaded, _ = engine.load_checkpoint(path)
    engine.destroy()
    return message, os.path.basename(loaded)


def test_a_failed_async_save_is_raised_at_the_wait_and_latest_keeps_the_previous_tag(tmp_path):
    results = spawn(async_save_that_fails, world_size=2, args=(str(tmp_path / "ck"),))
    for message, loaded in results:
        assert message is not None and "failed in the background" in message, message
        assert loaded == "global_step1"
    assert "No space left on device" in results[0][0] + results[1][0]
    assert (tmp_path / "ck" / "latest").read_text() == "global_step1"
    assert not (tmp_path / "ck" / "global_step2").exists()


def node_local_storage(rank, world_size):
    config = _config(1, checkpoint={"use_node_local_storage": True, "load_universal": True,
                                    "parallel_write": {"pipeline_stage": True}})
    engine, *_ = ds_all.initialize(model=_model(), config=config)  # one node: the storage is shared
    engine.destroy()
    return True


def node_local_storage_on_two_nodes(rank, world_size):
    ds_all.initialize(model=_model(), config=_config(1, checkpoint={"use_node_local_storage": True}))


def test_node_local_storage_is_honoured_on_one_node_and_refused_across_nodes():
    assert spawn(node_local_storage, world_size=2) == [True, True]
    with pytest.raises(RankFailed, match=r"checkpoint\.use_node_local_storage on 2 nodes is not implemented"):
        spawn(node_local_storage_on_two_nodes, world_size=2, env={"LOCAL_WORLD_SIZE": "1"})
