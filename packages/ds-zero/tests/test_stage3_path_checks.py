"""ZeRO stage 3's path checks cost O(1) collectives per forward and per backward, not one per gather, and a
rank that leaves the path in backward (not only in forward) still fails every rank at once, naming modules,
with no collective left half-issued (the harness's teardown barrier would hang on one)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ds_comm
from ds_comm.testing import spawn
from ds_zero import ZeroOptimizer

WIDTH = 16
CONFIG = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 600}


class Deep(nn.Module):
    """``layers`` linear layers, one unit each; ``self.skip`` leaves the last one out (set per rank by a test)."""

    def __init__(self, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(layers))
        self.skip = False

    def forward(self, x):
        for k, layer in enumerate(self.layers):
            if not (self.skip and k == len(self.layers) - 1):
                x = torch.tanh(layer(x))
        return x.square().mean()


def _x(rank, step):
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(100 * step + rank))


def counted(rank, world_size, layers):
    """Per step: the check all-gathers (tiny int64 rows on the check group) and the gathers of units."""
    torch.manual_seed(0)
    model = Deep(layers)
    zero = ZeroOptimizer(model, torch.optim.SGD, optimizer_kwargs={"lr": 0.1}, config=CONFIG)
    out = []
    for step in range(5):
        ds_comm.configure(enabled=True)
        ds_comm.comms_logger.reset()
        zero.backward(model(_x(rank, step)))
        zero.step()
        zero.zero_grad()
        records = ds_comm.comms_logger.records()
        ds_comm.configure(enabled=False)
        checks = sum(r.count for r in records if r.op == "all_gather_into_tensor")
        gathers = sum(r.count for r in records if r.op == "all_gather_bucket")
        out.append((checks, gathers))
    zero.close()
    return out


def test_path_checks_do_not_grow_with_the_number_of_gathers():
    per_model = {}
    for layers in (4, 12):
        steps = spawn(counted, world_size=2, args=(layers,))
        assert steps[0] == steps[1]
        per_model[layers] = steps[0]
    for layers, steps in per_model.items():
        assert all(gathers >= layers for _, gathers in steps), (layers, steps)  # every unit at least once a step
        # the first step checks each gather; the second expects the first's gathers (prefetching now: it
        # leaves them once, all ranks alike); from the third on one check per forward and one per backward
        assert steps[0][0] >= layers, (layers, steps)
        assert [checks for checks, _ in steps[2:]] == [2, 2, 2], (layers, steps)
    assert per_model[12][-1][1] > per_model[4][-1][1]


def parted_in_backward(rank, world_size):
    torch.manual_seed(0)
    model = Deep(6)
    zero = ZeroOptimizer(model, torch.optim.SGD, optimizer_kwargs={"lr": 0.1}, config=CONFIG)
    for step in range(3):  # the path is trusted from here on
        zero.backward(model(_x(rank, step)))
        zero.step()
        zero.zero_grad()
    loss = model(_x(rank, 3))
    if rank == 1:  # the same forward, but backward reaches the first layers only through another path
        loss = loss.detach() + model.layers[0](torch.zeros(1, WIDTH)).sum() * 0
    try:
        zero.backward(loss)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_ranks_that_part_in_backward_fail_at_once_naming_the_modules():
    messages = spawn(parted_in_backward, world_size=2, timeout=120)  # teardown: a barrier on the data group
    assert messages[0] == messages[1], messages
    assert "the ranks took different paths through the model (rank 0: " in messages[0], messages
    assert "(backward)" in messages[0], messages


def parted_in_forward(rank, world_size, layers):
    torch.manual_seed(0)
    model = Deep(layers)
    zero = ZeroOptimizer(model, torch.optim.SGD, optimizer_kwargs={"lr": 0.1}, config=CONFIG)
    for step in range(3):
        zero.backward(model(_x(rank, step)))
        zero.step()
        zero.zero_grad()
    model.skip = rank == 0
    try:
        zero.backward(model(_x(rank, 3)))
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("layers", [2, 8])
def test_ranks_that_part_in_a_trusted_forward_fail_at_once_naming_the_modules(layers):
    messages = spawn(parted_in_forward, world_size=2, args=(layers,), timeout=120)
    assert messages[0] == messages[1], messages
    assert (f"(rank 0: the end of the forward; rank 1: the parameters of 'layers.{layers - 1}' (forward))"
            in messages[0]), messages


def after_a_new_process_group(rank, world_size):
    """Stage 3 in a process group, that group destroyed and a new one made (as a script running two jobs, or
    a test harness, does): the path check's groups of the first are not used in the second."""
    import os

    import torch.distributed as dist

    losses = []
    for run in range(2):
        if run:
            dist.destroy_process_group()
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['DS_TEST_SECOND_PORT']}",
                                    rank=rank, world_size=world_size)
        torch.manual_seed(0)
        model = Deep(3)
        zero = ZeroOptimizer(model, torch.optim.SGD, optimizer_kwargs={"lr": 0.1}, config=CONFIG)
        for step in range(2):
            loss = model(_x(rank, step))
            zero.backward(loss)
            zero.step()
            zero.zero_grad()
        losses.append(loss.item())
        zero.close()
    return losses


def test_a_new_process_group_gets_new_check_groups(monkeypatch):
    from ds_comm.testing import free_port

    monkeypatch.setenv("DS_TEST_SECOND_PORT", str(free_port()))
    for rank, (first, second) in enumerate(spawn(after_a_new_process_group, world_size=2)):
        assert first == second, rank  # each rank's run, the same in both process groups
