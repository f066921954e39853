"""Sharded checkpoints: a run saved at step 5 and resumed in new processes continues bit for bit
(stages 0-3, fp32 and fp16 with loss scaling, CPU offload, ZeRO-Infinity's states and parameters on
NVMe); a checkpoint of N ranks at stage s loads into M ranks at stage t with the master weights and
Adam states element for element (every piece compared with the saved run's whole tensors), also into
and out of NVMe; another model's checkpoint is refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ds_comm
from ds_comm.testing import spawn
from ds_zero import GatheredParameters, ZeroOptimizer, load_zero_checkpoint, save_zero_checkpoint

WIDTH, STEPS, SAVE_AT = 24, 8, 4


def _model(extra: int = 0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.Tanh(), nn.Linear(WIDTH, 4 + extra))


def _zero(model, stage, precision="fp32", offload=False, nvme=None, params_on_nvme=True):
    """``nvme``: a directory for ZeRO-Infinity (stage 3: Adam's states, and with ``params_on_nvme`` the
    parameters, in files; chunks of 200 elements, so pieces of parameters cross chunks)."""
    config = {"stage": stage, "reduce_bucket_size": 300}  # several buckets, parameters split across ranks
    if stage == 3:
        config["stage3_param_persistence_threshold"] = 0  # every unit partitioned, even the LayerNorm
    if offload:
        config["offload_optimizer"] = {"device": "cpu"}
    if nvme is not None:
        config.update(sub_group_size=200, offload_optimizer={"device": "nvme", "nvme_path": nvme})
        if params_on_nvme:
            config["offload_param"] = {"device": "nvme", "nvme_path": nvme}
    return ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs={"lr": 1e-2}, config=config,
                         fp16={"enabled": precision == "fp16", "initial_scale_power": 8, "auto_cast": True},
                         bf16={"enabled": precision == "bf16"}, gradient_clipping=1.0)


def _train(zero, model, steps, rank, world_size, start=0):
    for step in range(start, steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8 // world_size, WIDTH, generator=g).to(next(model.parameters()).dtype)  # bf16 models
        zero.backward(model(x).float().square().mean())
        zero.step()
        zero.zero_grad()


def _params(model):
    with GatheredParameters(list(model.parameters())):  # stage 3: whole for a moment
        return [p.detach().float().clone() for p in model.parameters()]


def continuation(rank, world_size, stage, precision, offload, path, nvme=None, params_on_nvme=True):
    model = _model()
    zero = _zero(model, stage, precision, offload, nvme, params_on_nvme)
    _train(zero, model, SAVE_AT, rank, world_size)
    save_zero_checkpoint(zero, path)
    _train(zero, model, STEPS, rank, world_size, start=SAVE_AT)
    uninterrupted = _params(model)
    torch.manual_seed(123)  # a different init: everything must come from the checkpoint
    resumed_model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.Tanh(), nn.Linear(WIDTH, 4))
    resumed = _zero(resumed_model, stage, precision, offload, nvme, params_on_nvme)
    load_zero_checkpoint(resumed, path)
    _train(resumed, resumed_model, STEPS, rank, world_size, start=SAVE_AT)
    same = all(torch.equal(a, b) for a, b in zip(uninterrupted, _params(resumed_model), strict=True))
    return same, resumed.loss_scale, zero.loss_scale


@pytest.mark.parametrize("stage, precision, offload", [(0, "fp32", False), (1, "fp32", False), (2, "fp32", False),
                                                       (2, "fp16", False), (2, "fp32", True), (3, "fp32", False),
                                                       (3, "fp16", False)])
def test_a_resumed_run_continues_bit_for_bit(tmp_path, stage, precision, offload):
    for same, resumed_scale, scale in spawn(continuation, world_size=2,
                                            args=(stage, precision, offload, str(tmp_path / "ck"))):
        assert same
        assert resumed_scale == scale


@pytest.mark.parametrize("precision, params_on_nvme", [("fp32", True), ("bf16", True), ("fp16", False)])
def test_a_zero_infinity_run_resumes_bit_for_bit(tmp_path, precision, params_on_nvme):
    # the master copy is the parameter file (fp32), a file of its own (bf16: the 16-bit parameter file is
    # rounded from it after loading), or its own file with the 16-bit partition in RAM (fp16)
    for same, resumed_scale, scale in spawn(continuation, world_size=2, args=(
            3, precision, False, str(tmp_path / "ck"), str(tmp_path / "nvme"), params_on_nvme)):
        assert same
        assert resumed_scale == scale
    assert not list((tmp_path / "nvme").iterdir())  # the runs' files are gone


def _whole(zero, model, stage, world_size) -> dict[str, list[float]]:
    """Every parameter and both Adam moments, whole, by parameter name: at stage 0 a rank holds them
    all; at stages 1-2 each rank's pieces are summed over ranks (they are disjoint)."""
    names = {id(q): n for n, q in model.named_parameters()}
    with GatheredParameters(list(model.parameters())):
        whole = {f"master/{n}": p.detach().clone().flatten() for n, p in model.named_parameters()}
    on_disk = zero._nvme.read_all() if zero._nvme is not None else None  # ZeRO-Infinity: in partition order
    for key in ("exp_avg", "exp_avg_sq"):
        moments = {n: torch.zeros(whole[f"master/{n}"].numel()) for n, p in model.named_parameters()}
        for rank in range(world_size) if stage == 0 else [zero.rank]:
            for piece in zero.layout.pieces(rank):
                slot, bucket = zero.layout.slots[piece.index], zero.layout.buckets[piece.bucket]
                if on_disk is not None:
                    tensor, at = on_disk[key], piece.partition_offset
                else:
                    tensor = zero.optimizer.state[zero._step_params[piece.bucket]][key]
                    at = (slot.offset + piece.param_offset - bucket.offset) if stage == 0 else \
                        piece.partition_offset - zero._shard_starts[piece.bucket]
                moments[names[id(zero._params[piece.index])]][piece.param_offset:piece.param_offset + piece.numel] = \
                    tensor[at:at + piece.numel]
        for name, tensor in moments.items():
            if stage > 0 and world_size > 1:
                ds_comm.all_reduce(tensor)
            whole[f"{key}/{name}"] = tensor
    return {k: v.tolist() for k, v in whole.items()}  # plain lists: tensors do not travel back from a rank


def save_run(rank, world_size, stage, path, nvme=None):
    model = _model()
    zero = _zero(model, stage, nvme=nvme)
    _train(zero, model, SAVE_AT, rank, world_size)
    save_zero_checkpoint(zero, path)
    return _whole(zero, model, stage, world_size)


def load_elsewhere(rank, world_size, stage, path, nvme=None):
    model = _model()
    zero = _zero(model, stage, nvme=nvme)
    load_zero_checkpoint(zero, path)
    whole = _whole(zero, model, stage, world_size)
    step = {float(zero.optimizer.state[t]["step"]) for t in zero._step_params}
    _train(zero, model, SAVE_AT + 1, rank, world_size, start=SAVE_AT)  # and it trains on
    return whole, step


@pytest.mark.parametrize("saved, loaded", [((2, 2), (1, 2)), ((1, 2), (2, 1)), ((2, 1), (2, 0)), ((2, 0), (2, 2)),
                                           ((2, 3), (1, 2)), ((2, 2), (2, 3))])
def test_a_checkpoint_loads_on_another_world_size_or_stage(tmp_path, saved, loaded):
    path = str(tmp_path / "ck")
    truth = spawn(save_run, world_size=saved[0], args=(saved[1], path))[0]
    for whole, step in spawn(load_elsewhere, world_size=loaded[0], args=(loaded[1], path)):
        assert step == {float(SAVE_AT)}
        assert sorted(whole) == sorted(truth)
        for key in truth:
            assert whole[key] == truth[key], key  # element for element


@pytest.mark.parametrize("saved, loaded", [((2, True), (1, False)), ((2, False), (2, True))])
def test_zero_infinity_checkpoints_load_on_other_world_sizes_and_stages(tmp_path, saved, loaded):
    # out of NVMe (2 ranks, stage 3, states and parameters in files) into 1 rank at stage 2, and from 2
    # ranks at stage 2 into NVMe: the pieces read from and written to the files element for element
    path, nvme = str(tmp_path / "ck"), str(tmp_path / "nvme")
    truth = spawn(save_run, world_size=saved[0], args=(3 if saved[1] else 2, path, nvme if saved[1] else None))[0]
    for whole, step in spawn(load_elsewhere, world_size=loaded[0],
                             args=(3 if loaded[1] else 2, path, nvme if loaded[1] else None)):
        assert step == {float(SAVE_AT)}
        assert sorted(whole) == sorted(truth)
        for key in truth:
            assert whole[key] == truth[key], key


def wrong_model(rank, world_size, path):
    model = _model()
    zero = _zero(model, 1)
    _train(zero, model, 1, rank, world_size)
    save_zero_checkpoint(zero, path)
    other = _model(extra=1)
    try:
        load_zero_checkpoint(_zero(other, 1), path)
    except ValueError as e:
        return str(e)
    return "NOT REFUSED"


def test_another_models_checkpoint_is_refused_by_name(tmp_path):
    for message in spawn(wrong_model, world_size=2, args=(str(tmp_path / "ck"),)):
        assert "the checkpoint is of another model" in message
        assert "3.weight: saved [4, 24], model [5, 24]" in message
    with pytest.raises(FileNotFoundError, match="not a ds-zero checkpoint"):
        from ds_zero import read_zero_metadata

        read_zero_metadata(tmp_path)


def save_for_export(rank, world_size, path):
    model = _model()
    zero = _zero(model, 2)
    _train(zero, model, 2, rank, world_size)
    save_zero_checkpoint(zero, path)
    return {k: v.tolist() for k, v in model.state_dict().items()}


def test_the_fp32_export_reads_every_shard_in_one_process(tmp_path):
    import json
    import subprocess
    import sys

    from ds_zero import (
        get_fp32_state_dict_from_zero_checkpoint,
        load_state_dict_from_zero_checkpoint,
    )

    path = tmp_path / "ck"
    expected = spawn(save_for_export, world_size=2, args=(str(path),))[0]
    state = get_fp32_state_dict_from_zero_checkpoint(path)  # no process group here
    assert list(state) == list(expected)
    assert {k: v.tolist() for k, v in state.items()} == expected
    assert load_state_dict_from_zero_checkpoint(_model(extra=0), path).state_dict()["0.weight"].tolist() == \
        expected["0.weight"]
    safetensors = pytest.importorskip("safetensors.torch", reason="pip install safetensors (ds-zero[safetensors])")
    out = tmp_path / "model.safetensors"
    result = subprocess.run([sys.executable, "-m", "ds_zero._export", str(path), str(out), "--safetensors",
                             "--max_shard_size", "1KB"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all(f.startswith("model-0000") for f in files)
    loaded = {}
    for name in files:
        loaded.update(safetensors.load_file(str(tmp_path / name)))
    assert {k: v.tolist() for k, v in loaded.items()} == expected
    bad = subprocess.run([sys.executable, "-m", "ds_zero._export", str(tmp_path / "nothing"), str(out)],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "neither a ZeRO checkpoint" in bad.stderr


class _Payload:
    """Unpickling this creates a file: the proof that loading ran code."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


def test_a_crafted_checkpoint_executes_nothing(tmp_path):
    import pickle

    from ds_zero import get_fp32_state_dict_from_zero_checkpoint

    path = tmp_path / "ck"
    spawn(save_for_export, world_size=2, args=(str(path),))
    proof = tmp_path / "pwned"
    metadata = path / ".metadata"
    original = metadata.read_bytes()
    metadata.write_bytes(pickle.dumps(_Payload(str(proof))))  # DCP itself would pickle.load this
    with pytest.raises(ValueError, match=r"refusing to load: its metadata asks for io\.open|builtins\.open"):
        get_fp32_state_dict_from_zero_checkpoint(path)
    assert not proof.exists()
    metadata.write_bytes(original[: len(original) // 2])  # torn
    with pytest.raises(ValueError, match="truncated or corrupt"):
        get_fp32_state_dict_from_zero_checkpoint(path)
    metadata.unlink()
    with pytest.raises(FileNotFoundError, match="missing"):
        get_fp32_state_dict_from_zero_checkpoint(path)
