"""Checkpoints written by an earlier ds-zero load bit for bit: ``fixtures/zero_checkpoints/`` holds small
checkpoints of 2 ranks written by ds-zero at main 280a07e (stages 0-3; fp16 with its loss scaler, bf16,
CPU offload, ZeRO-Infinity with the optimizer and the parameters on NVMe), each with the values the
saving run held (``expected.pt``: the whole parameters, master weights, Adam moments and step, the frozen
parameter and the buffer, the loss scale). Each is loaded into a model initialised otherwise and every value
is compared element for element, so a change of ds-zero's internals that moves an offset, a shard or a key
fails here. The fixture is data: never write it again with newer code (`write_fixture` is how it was made,
kept to show what it holds)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from torch import nn

from ds_comm.testing import spawn
from ds_zero import (
    GatheredParameters,
    ZeroOptimizer,
    load_zero_checkpoint,
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
    save_zero_checkpoint,
)

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "zero_checkpoints")
WIDTH = 10
# name: (stage, precision, offload_optimizer device, parameters on NVMe)
CASES = {"stage0": (0, "fp32", None, False), "stage1_fp16": (1, "fp16", None, False), "stage2": (2, "fp32", None, False),
         "stage2_offload": (2, "fp32", "cpu", False), "stage3": (3, "fp32", None, False),
         "stage3_bf16": (3, "bf16", None, False), "stage3_nvme": (3, "fp32", "nvme", True)}


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.Tanh(), nn.Linear(WIDTH, 3))
    nn.init.normal_(model[1].bias).requires_grad_(False)  # a frozen parameter (``module/<name>``)
    model.register_buffer("offset", torch.randn(3))  # a buffer (``module/offset``)
    return model


def _zero(model: nn.Module, case: str, nvme: str) -> ZeroOptimizer:
    stage, precision, offload, params_on_nvme = CASES[case]
    config: dict = {"stage": stage, "reduce_bucket_size": 70}  # several buckets; parameters split across ranks
    if stage == 3:
        config["stage3_param_persistence_threshold"] = 0
    if offload is not None:
        config["offload_optimizer"] = {"device": offload, "nvme_path": nvme}
    if offload == "nvme":
        config["sub_group_size"] = 50  # chunks that pieces of parameters cross
    if params_on_nvme:
        config["offload_param"] = {"device": "nvme", "nvme_path": nvme}
    return ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.01}, config=config,
                         fp16={"enabled": precision == "fp16", "initial_scale_power": 6, "loss_scale_window": 1},
                         bf16={"enabled": precision == "bf16"}, gradient_clipping=1.0)


def _values(zero: ZeroOptimizer, model: nn.Module) -> dict[str, torch.Tensor]:
    """What the run holds now, whole, by name (a collective: every rank calls it)."""
    out: dict[str, torch.Tensor] = {}
    with GatheredParameters(list(model.parameters())):
        out.update({f"param/{n}": p.detach().clone() for n, p in model.named_parameters()})
    for name, p in model.named_parameters():
        if p.requires_grad:
            out[f"master/{name}"] = safe_get_full_fp32_param(p)
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{key}/{name}"] = safe_get_full_optimizer_state(p, key)
    out["buffer/offset"] = model.offset.detach().clone()
    out["step"] = torch.tensor(sorted({float(s["step"]) for s in zero.optimizer.state.values()}))
    out["loss_scale"] = torch.tensor(zero.loss_scale)
    out["skipped_steps"] = torch.tensor(zero.skipped_steps)
    return out


def _train(zero: ZeroOptimizer, model: nn.Module, steps: int, rank: int) -> None:
    dtype = model[0].weight.dtype
    for step in range(steps):
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(10 * step + rank)).to(dtype)
        zero.backward((model(x).float() + model.offset.float()).square().mean())
        zero.step()
        zero.zero_grad()


def save_case(rank: int, world_size: int, case: str, path: str, nvme: str) -> None:
    model = _model(0)
    zero = _zero(model, case, nvme)
    _train(zero, model, 3, rank)
    save_zero_checkpoint(zero, path)
    values = _values(zero, model)
    if rank == 0:
        torch.save(values, os.path.join(path, "expected.pt"))
    zero.close()


def write_fixture(nvme: str) -> None:
    """How the fixture was made (at main 280a07e): ``python -c "import sys; sys.path.insert(0,
    'packages/ds-zero/tests'); import test_checkpoint_fixture as t; t.write_fixture('/tmp/nvme')"``."""
    for case in CASES:
        path = os.path.join(FIXTURE, case)
        shutil.rmtree(path, ignore_errors=True)
        spawn(save_case, world_size=2, args=(case, path, nvme))


def load_cases(rank: int, world_size: int, nvme: str) -> dict[str, list[str]]:
    wrong = {}
    for case in CASES:
        path = os.path.join(FIXTURE, case)
        model = _model(1)  # other values: everything must come from the checkpoint
        zero = _zero(model, case, os.path.join(nvme, case))
        meta = load_zero_checkpoint(zero, path)
        expected = torch.load(os.path.join(path, "expected.pt"), weights_only=True)
        loaded = _values(zero, model)
        wrong[case] = sorted(k for k in expected if k not in loaded or loaded[k].dtype != expected[k].dtype
                             or not torch.equal(loaded[k], expected[k]))
        wrong[case] += sorted(k for k in loaded if k not in expected)
        if meta["micro_step"] != 3:
            wrong[case].append(f"micro_step {meta['micro_step']}")
        _train(zero, model, 1, rank)  # and it trains on
        zero.close()
    return wrong


def test_checkpoints_of_main_280a07e_load_bit_for_bit(tmp_path):
    assert sorted(os.listdir(FIXTURE)) == sorted(CASES)
    for wrong in spawn(load_cases, world_size=2, args=(str(tmp_path),), timeout=300):
        assert wrong == {case: [] for case in CASES}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_fixture_is_small(case):
    files = [os.path.join(root, f) for root, _, names in os.walk(os.path.join(FIXTURE, case)) for f in names]
    assert {os.path.basename(f) for f in files} >= {"zero_meta.json", ".metadata", "expected.pt"}
    assert sum(os.path.getsize(f) for f in files) < 100_000
