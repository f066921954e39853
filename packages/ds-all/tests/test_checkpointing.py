"""ds_all.checkpointing: gradients through `checkpoint` equal the plain function's exactly (dropout
included, by the saved random state), with every option of the ``activation_checkpointing`` section:
partitioned across a model-parallel group of 2 ranks (inputs all-gathered in backward, counted by the
comms logger), contiguous buffers, CPU copies, profiling; and misuse refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ds_all
import ds_comm
from ds_all import checkpointing
from ds_comm.testing import spawn


class Block(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(width, 2 * width), nn.Linear(2 * width, width), nn.Dropout(0.3)

    def forward(self, x, scale=1.0, mask=None):
        h = self.drop(torch.tanh(self.fc1(x))) * scale
        if mask is not None:
            h = h * mask
        return x + self.fc2(h), h.sum()


def _model() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(Block() for _ in range(3))


def _run(blocks: nn.ModuleList, x: torch.Tensor, use_checkpoint: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(1)  # the dropout masks
    total = 0.0
    mask = (torch.arange(32) % 3 != 0).float()
    for block in blocks:
        if use_checkpoint:
            x, extra = checkpointing.checkpoint(block, x, 0.5, mask)
        else:
            x, extra = block(x, 0.5, mask)
        total = total + extra
    loss = x.square().mean() + 0.01 * total
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in blocks.parameters()]


def _same_as_plain(input_grad: bool = True, **settings) -> tuple[bool, bool]:
    checkpointing.configure(None, **settings)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
    loss, grads = _run(_model(), x.clone().requires_grad_(input_grad), use_checkpoint=False)
    loss_c, grads_c = _run(_model(), x.clone().requires_grad_(input_grad), use_checkpoint=True)
    return torch.equal(loss, loss_c), all(torch.equal(a, b) for a, b in zip(grads, grads_c, strict=True))


@pytest.mark.parametrize("settings", [{}, {"checkpoint_in_cpu": True}, {"profile": True}])
def test_gradients_equal_the_plain_functions_dropout_included(settings):
    assert _same_as_plain(**settings) == (True, True)
    if settings.get("profile"):
        times = checkpointing.profile_times()
        assert len(times) == 3 and all(f > 0 and r > 0 for f, r in times)


def test_parameters_get_gradients_when_no_input_needs_one():
    """The first block's input (token embeddings fed in, data) requires no gradient: its parameters
    still get theirs (a reentrant checkpoint without care returns none)."""
    assert _same_as_plain(input_grad=False) == (True, True)


def test_the_random_state_outside_is_left_as_a_plain_run_leaves_it():
    checkpointing.configure(None)
    block, x = Block(), torch.randn(2, 16, requires_grad=True)
    torch.manual_seed(5)
    block(x)[0].sum().backward()
    plain_next = torch.rand(3)
    torch.manual_seed(5)
    checkpointing.checkpoint(block, x)[0].sum().backward()
    assert torch.equal(torch.rand(3), plain_next)


def test_the_model_parallel_tracker_forks_a_state_that_the_recompute_replays():
    checkpointing.configure(None)
    checkpointing.model_parallel_cuda_manual_seed(123)
    tracker = checkpointing.get_cuda_rng_tracker()
    drop, w = nn.Dropout(0.5), torch.randn(64, requires_grad=True)

    def region(x):
        with tracker.fork():
            return drop(x * 2)

    region(w).sum().backward()  # plain
    plain = w.grad.clone()
    w.grad = None
    checkpointing.model_parallel_cuda_manual_seed(123)
    checkpointing.checkpoint(region, w).sum().backward()
    assert torch.equal(w.grad, plain) and 0 < (plain == 0).sum() < 64
    with pytest.raises(ValueError, match="seed 1000 is already used"):
        tracker.add("other", 1000), tracker.add("third", 1000)
    with pytest.raises(RuntimeError, match="no state named 'nope'"), tracker.fork("nope"):
        pass


class _MPU:
    """Both ranks form one model-parallel group (their block inputs are the same, as under tensor
    parallelism)."""

    def get_model_parallel_group(self):
        return None

    def get_model_parallel_rank(self):
        return ds_comm.get_rank()

    def get_model_parallel_world_size(self):
        return ds_comm.get_world_size()


def partitioned(rank, world_size, contiguous):
    ds_comm.configure(enabled=True, verbose=False)
    settings = {"partition_activations": True}
    if contiguous:
        settings.update(contiguous_memory_optimization=True, number_checkpoints=3)
    checkpointing.configure(_MPU(), deepspeed_config={"activation_checkpointing": settings})
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))  # the same on both ranks
    loss, grads = _run(_model(), x.clone().requires_grad_(True), use_checkpoint=False)
    ds_comm.comms_logger.reset() if hasattr(ds_comm.comms_logger, "reset") else None
    loss_c, grads_c = _run(_model(), x.clone().requires_grad_(True), use_checkpoint=True)
    gathers = sum(r["count"] for r in ds_comm.log_summary() if r["op"] == "all_gather_into_tensor")
    same = torch.equal(loss, loss_c) and all(torch.equal(a, b) for a, b in zip(grads, grads_c, strict=True))
    return same, gathers


@pytest.mark.parametrize("contiguous", [False, True])
def test_partitioned_activations_are_gathered_back_exactly(contiguous):
    for same, gathers in spawn(partitioned, world_size=2, args=(contiguous,)):
        assert same
        assert gathers == 3 * 2  # 3 checkpoints x 2 tensor inputs (x and mask) gathered in backward


def test_misuse_is_refused_by_name():
    with pytest.raises(ValueError, match="contiguous_memory_optimization needs partition_activations"):
        checkpointing.configure(None, contiguous_checkpointing=True, num_checkpoints=2)
    with pytest.raises(ValueError, match="contiguous_memory_optimization needs number_checkpoints"):
        checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True)
    with pytest.raises(ValueError, match="number_checkpoints"):
        checkpointing.configure(None, partition_activations=True, num_checkpoints=0)
    with pytest.raises(ValueError, match="function must be callable, got int"):
        checkpointing.checkpoint(3, torch.ones(1))
    checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=1)
    block = Block()
    x = torch.randn(2, 16, requires_grad=True)
    checkpointing.checkpoint(block, x)
    with pytest.raises(RuntimeError, match="number_checkpoints=1; raise it"):
        checkpointing.checkpoint(block, x)
    checkpointing.configure(None)


def configured_by_initialize(rank, world_size):
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "activation_checkpointing": {"profile": True, "cpu_checkpointing": True}}
    engine, *_ = ds_all.initialize(model=Block(), config=config)
    out, _ = checkpointing.checkpoint(engine, torch.randn(2, 16))
    engine.backward(out.square().mean())
    engine.step()
    result = checkpointing.is_configured(), len(checkpointing.profile_times())
    engine.destroy()
    return result


def test_initialize_configures_checkpointing_from_the_config():
    for configured, profiled in spawn(configured_by_initialize, world_size=2):
        assert configured and profiled == 1
