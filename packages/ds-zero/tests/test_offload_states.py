"""ZeroOptimizer.offload_states / reload_states (DeepSpeed's engine methods) and
set_gradient_accumulation_boundary: training around them is bitwise the training without them, with
the states really copied (the re-pointing of every view run on the CPU by forcing the copies), and bad
input is named."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ds_zero._offload_states as offload_module
from ds_comm.testing import spawn
from ds_zero import OffloadDeviceEnum, OffloadStateTypeEnum, ZeroOptimizer

WIDTH, STEPS, GAS = 16, 3, 2
CASES = [  # (stage, precision)
    (0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (1, "bf16"), (2, "bf16"), (3, "bf16")]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 2))


def _zero(model: nn.Module, stage: int, precision: str, gas: int = GAS) -> ZeroOptimizer:
    config = {"stage": stage, "reduce_bucket_size": 200}
    if stage == 3:
        config["stage3_param_persistence_threshold"] = 0
    return ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs={"lr": 1e-2},
                         config=config, bf16={"enabled": precision == "bf16"}, gradient_accumulation_steps=gas)


def _loss(model: nn.Module, step: int, micro: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    x = torch.randn(4, WIDTH, generator=g)
    return model(x.to(next(model.parameters()).dtype)).float().square().mean()


def _snapshot(model: nn.Module, zero: ZeroOptimizer) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for per_tensor in zero.optimizer.state.values():
        out += [v.detach().clone() for v in per_tensor.values() if torch.is_tensor(v)]
    return out


def train_with_offloads(rank, world_size, force):
    if force:  # copy every root even where it already is: the re-pointing runs as it would on a GPU
        original = offload_module._move_root
        offload_module._move_root = lambda *a, **k: original(*a, **{**k, "force": True})
    results = []
    for stage, precision in CASES:
        plain_model, moved_model = _model(), _model()
        plain, moved = _zero(plain_model, stage, precision), _zero(moved_model, stage, precision)
        moves = []  # per offload: whether the flat buffer moved
        for step in range(STEPS):
            for micro in range(GAS):
                for model, zero in ((plain_model, plain), (moved_model, moved)):
                    zero.backward(_loss(model, step, micro, rank))
                    zero.step()
                    zero.zero_grad()
                before = moved._flat.untyped_storage().data_ptr()
                moved.offload_states(pin_memory=step % 2 == 0)
                assert moved.offloaded_states == set(OffloadStateTypeEnum)
                moves.append(moved._flat.untyped_storage().data_ptr() != before)
                if step == 1:  # some states only, twice: the second call moves nothing more
                    moved.reload_states()
                    moved.offload_states(include=[OffloadStateTypeEnum.lp_grads, "optim_states"])
                    moved.offload_states(include=(OffloadStateTypeEnum.lp_grads,))
                    assert moved.offloaded_states == {OffloadStateTypeEnum.lp_grads, OffloadStateTypeEnum.optim_states}
                moved.reload_states()
                assert moved.offloaded_states == set()
        same = all(torch.equal(a, b) for a, b in zip(_snapshot(plain_model, plain), _snapshot(moved_model, moved),
                                                     strict=True))
        plain.close()
        moved.close()
        results.append((stage, precision, same, moves))
    return results


@pytest.mark.parametrize("force", [False, True], ids=["in-place", "copied"])
def test_offload_and_reload_around_steps_leave_training_bitwise_the_same(force):
    for results in spawn(train_with_offloads, world_size=2, args=(force,), timeout=240):
        for stage, precision, same, moves in results:
            assert same, (stage, precision, force)
            # copied: the flat buffer really moved each time; in place (CPU): nothing moved
            assert moves == [force] * (STEPS * GAS), (stage, precision, moves)


def bad_offload_input(rank, world_size):
    zero = _zero(_model(), 1, "fp32")
    errors = []
    for kwargs in ({"include": ["optim_states", "master_weights"]}, {"include": "optim_states"},
                   {"include": [3]}, {"device": "gpu"}, {"device": OffloadDeviceEnum.nvme}):
        with pytest.raises(ValueError) as info:
            zero.offload_states(**kwargs)
        errors.append(str(info.value))
    zero.offload_states(device=OffloadDeviceEnum.none)  # a warning, nothing moved
    assert zero.offloaded_states == set()
    with pytest.raises(ValueError, match="True, False or None"):
        zero.set_gradient_accumulation_boundary(1)
    zero.close()
    with pytest.raises(RuntimeError, match="closed"):
        zero.offload_states()
    return errors


def test_bad_offload_input_is_named():
    for errors in spawn(bad_offload_input, world_size=1):
        assert "'master_weights'" in errors[0] and "optim_states, hp_params" in errors[0]
        assert "collection" in errors[1] and "3" in errors[2]
        assert "'gpu'" in errors[3] and "nvme" in errors[4]


def manual_boundaries(rank, world_size):
    """DeepSpeed's set_gradient_accumulation_boundary pattern (False for GAS - 1 backwards without a
    step, True for the last, one step) against counted accumulation."""
    out = []
    for stage, precision in CASES:
        counted_model, manual_model = _model(), _model()
        counted, manual = _zero(counted_model, stage, precision), _zero(manual_model, stage, precision)
        for step in range(STEPS):
            for micro in range(GAS):
                counted.backward(_loss(counted_model, step, micro, rank))
                counted.step()
                counted.zero_grad()
            manual.set_gradient_accumulation_boundary(False)
            for micro in range(GAS - 1):
                manual.backward(_loss(manual_model, step, micro, rank))
            manual.set_gradient_accumulation_boundary(True)
            manual.backward(_loss(manual_model, step, GAS - 1, rank))
            assert manual.step()
            manual.zero_grad()
        same = all(torch.equal(a, b) for a, b in zip(_snapshot(counted_model, counted),
                                                     _snapshot(manual_model, manual), strict=True))
        out.append((stage, precision, same))
        counted.close()
        manual.close()
    return out


def test_manual_accumulation_boundaries_train_as_counted_ones():
    for results in spawn(manual_boundaries, world_size=2, timeout=240):
        for stage, precision, same in results:
            assert same, (stage, precision)


def test_offload_states_keeps_the_objects_the_optimizer_holds():
    # the re-pointing alone, without a process group: views follow their root, objects stay the same
    root = torch.arange(12.0)
    view, param = root[2:6].view(2, 2), nn.Parameter(torch.zeros(3))
    param.data = root[6:9]
    assert offload_module._move_root(root, torch.device("cpu"), [view, param], pin_memory=True, non_blocking=False,
                                     force=True)
    root.add_(100)
    assert torch.equal(view, torch.tensor([[102.0, 103.0], [104.0, 105.0]]))
    assert torch.equal(param.data, torch.tensor([106.0, 107.0, 108.0]))
    assert not offload_module._move_root(root, torch.device("cpu"), [view], pin_memory=False, non_blocking=False)
