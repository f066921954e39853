"""A ZeRO-3 parameter as DeepSpeed's users and Hugging Face see it, on 2 ranks: empty outside its gathers,
with ``ds_tensor`` (its shard), ``ds_numel``, ``ds_shape``, ``ds_status`` and ``ds_id`` under `Init` and
after `ZeroOptimizer` took the model; a tied weight read in another module's forward (DeepSpeed gathers
it on access) trains as plain PyTorch does; `Init` without a process group starts one from the
environment.

DeepSpeed 0.19.8 measured (2 ranks, CPU): under ``zero.Init`` a ``(10, 6)`` embedding weight has shape
``(0,)``, ``ds_tensor`` of 30 elements (``ds_tensor.ds_numel`` 30: rank r's half of the flattened
weight), status ``NOT_AVAILABLE``, ids 0, 1, 2 in creation order; ``AVAILABLE`` inside
``GatheredParameters``; a head reading ``owner.embed.weight`` in its own forward trains (the weight
becomes an external parameter of the head) and ``ds_tensor`` shows the optimizer's updates."""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ds_zero
from ds_comm.testing import spawn
from ds_zero import GatheredParameters, Init, ZeroOptimizer, ZeroParamStatus

VOCAB, DIM = 10, 6
STAGE3 = {"stage": 3, "stage3_param_persistence_threshold": 0}  # no unit stays whole: every one is gathered


class Head(nn.Module):
    """An LM head without weights of its own: it reads the embedding's (tied), with no
    register_external_parameter."""

    def __init__(self, owner: nn.Module):
        super().__init__()
        self.owner = [owner]  # not a submodule

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.owner[0].embed.weight)


class Tied(nn.Module):
    def __init__(self, via_parent: bool = False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mid = nn.Linear(DIM, DIM)
        self.head = Head(self)
        self.via_parent = via_parent

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(self.embed(tokens)))
        if self.via_parent:  # the parent's forward reads it (a module with no parameter of its own)
            return F.linear(h, self.embed.weight)
        return self.head(h)


def _tokens(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(100 * step + rank))


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _deepspeed_shard(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """DeepSpeed's ds_tensor: ceil(numel / world) elements, rank's slice of the flattened, zero-padded value."""
    size = -(-full.numel() // world_size)
    padded = torch.zeros(size * world_size, dtype=full.dtype)
    padded[:full.numel()] = full.reshape(-1)
    return padded[rank * size:(rank + 1) * size]


def _pieces(tensor: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    out = [None] * world_size
    dist.all_gather_object(out, tensor.detach().clone())
    return out


def attributes(rank, world_size):
    torch.manual_seed(0)
    plain = Tied()
    torch.manual_seed(0)
    with Init(config_dict_or_path={"zero_optimization": STAGE3}):
        model = Tied()
    params = dict(model.named_parameters())
    out = {"init": {name: (tuple(p.shape), p.numel(), tuple(p.ds_shape), p.ds_numel, p.ds_tensor.numel(),
                           p.ds_tensor.ds_numel, p.ds_status, p.ds_id) for name, p in params.items()},
           "init_shard_ok": all(torch.equal(p.ds_tensor, _deepspeed_shard(q.detach(), rank, world_size))
                                for p, q in zip(params.values(), plain.parameters(), strict=True))}
    with GatheredParameters(model.mid.bias):
        out["gathered"] = (model.mid.bias.ds_status, model.mid.bias.numel(), model.embed.weight.ds_status,
                           torch.equal(model.mid.bias, plain.mid.bias))
    out["after_gathered"] = (model.mid.bias.ds_status, model.mid.bias.numel())

    ids_before = {name: p.ds_id for name, p in params.items()}
    # reuse distance 0: a unit is released after each use (else the head's reuse keeps the embedding)
    zero = ZeroOptimizer(model, torch.optim.SGD, optimizer_kwargs={"lr": 0.5},
                         config={**STAGE3, "stage3_max_reuse_distance": 0})
    out["ids_kept"] = ids_before == {name: p.ds_id for name, p in params.items()}
    out["taken"] = {name: (p.numel(), p.ds_status, p.ds_numel, tuple(p.ds_shape), p.ds_tensor.ds_numel ==
                           p.ds_tensor.numel()) for name, p in params.items()}
    # this rank's shard: every rank's ds_tensor, in rank order, is the whole flattened parameter
    out["pieces_ok"] = all(torch.equal(torch.cat(_pieces(p.ds_tensor, world_size)), q.detach().reshape(-1))
                           for p, q in zip(params.values(), plain.parameters(), strict=True))

    seen = {}  # statuses inside forward: its own parameters whole, a module not yet run partitioned
    model.mid.register_forward_pre_hook(lambda m, a: seen.update(
        mid=(m.weight.ds_status, m.weight.numel()), embed_in_mid=params["embed.weight"].ds_status))
    for step in range(3):
        zero.backward(_loss(model, _tokens(step, rank)))
        zero.step()
        zero.zero_grad()
    out["in_forward"] = seen
    with GatheredParameters(model.embed.weight):
        out["held"] = (model.embed.weight.ds_status, model.embed.weight.numel(), model.mid.weight.ds_status)
    out["after_steps"] = {name: (p.numel(), p.ds_status) for name, p in params.items()}
    with GatheredParameters(list(params.values())):
        whole = {name: p.detach().clone() for name, p in params.items()}
    out["stepped_pieces_ok"] = all(torch.equal(torch.cat(_pieces(p.ds_tensor, world_size)), whole[name].reshape(-1))
                                   for name, p in params.items())
    out["moved"] = not torch.equal(whole["mid.weight"], plain.mid.weight)
    zero.close()
    out["closed"] = {name: (p.numel(), hasattr(p, "ds_tensor"), hasattr(p, "ds_status")) for name, p in
                     params.items()}
    return out


def test_a_zero3_parameter_carries_deepspeeds_attributes():
    results = spawn(attributes, world_size=2)
    names = ["embed.weight", "mid.weight", "mid.bias"]
    ids = []
    for rank, out in enumerate(results):
        init = out["init"]
        assert list(init) == names
        for name, shape in zip(names, [(VOCAB, DIM), (DIM, DIM), (DIM,)], strict=True):
            numel = torch.Size(shape).numel()
            assert init[name] == ((0,), 0, shape, numel, -(-numel // 2), -(-numel // 2), ZeroParamStatus.NOT_AVAILABLE,
                                  init[name][7]), (rank, name, init[name])
        assert out["init_shard_ok"]
        ids.append([init[name][7] for name in names])
        assert out["gathered"] == (ZeroParamStatus.AVAILABLE, DIM, ZeroParamStatus.NOT_AVAILABLE, True)
        assert out["after_gathered"] == (ZeroParamStatus.NOT_AVAILABLE, 0)
        assert out["ids_kept"]
        for name, shape in zip(names, [(VOCAB, DIM), (DIM, DIM), (DIM,)], strict=True):
            assert out["taken"][name] == (0, ZeroParamStatus.NOT_AVAILABLE, torch.Size(shape).numel(), shape, True)
        assert out["pieces_ok"] and out["stepped_pieces_ok"] and out["moved"]
        assert out["in_forward"] == {"mid": (ZeroParamStatus.AVAILABLE, DIM * DIM),
                                     "embed_in_mid": ZeroParamStatus.NOT_AVAILABLE}
        assert out["after_steps"] == {name: (0, ZeroParamStatus.NOT_AVAILABLE) for name in names}
        assert out["held"] == (ZeroParamStatus.AVAILABLE, VOCAB * DIM, ZeroParamStatus.NOT_AVAILABLE)
        assert out["closed"] == {"embed.weight": (VOCAB * DIM, False, False), "mid.weight": (DIM * DIM, False, False),
                                 "mid.bias": (DIM, False, False)}
    assert len(set(ids[0])) == 3 and all(isinstance(i, int) for i in ids[0])  # unique ints, in creation order
    assert ids[0] == sorted(ids[0]) and ids[0] == ids[1]


def tied(rank, world_size, via_parent, use_init):
    torch.manual_seed(0)
    reference = Tied(via_parent)
    if use_init:
        torch.manual_seed(0)
        with Init():
            model = Tied(via_parent)
    else:
        model = copy.deepcopy(reference)
    zero = ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs={"lr": 1e-2}, config=STAGE3)
    adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    losses, expected = [], []
    for step in range(6):
        loss = _loss(model, _tokens(step, rank))
        zero.backward(loss)
        zero.step()
        zero.zero_grad()
        losses.append(loss.item())
        # the reference: the mean of both ranks' losses in one process (what data parallelism computes)
        adamw.zero_grad()
        per_rank = [_loss(reference, _tokens(step, r)) for r in range(world_size)]
        (sum(per_rank) / world_size).backward()
        adamw.step()
        expected.append(per_rank[rank].item())
    embed_external = [type(m).__name__ for m in model.modules() if any(
        p is model.embed.weight for p in m.__dict__.get("_ds_external_parameters", ()))]
    zero.close()
    return losses, expected, [p.detach().clone() for p in model.parameters()], \
        [p.detach().clone() for p in reference.parameters()], embed_external


def _check_tied(results):
    for losses, expected, params, reference, _ in results:
        assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(params, reference, strict=True)), \
            max(float((a - b).abs().max()) for a, b in zip(params, reference, strict=True))
        assert len(losses) == 6 and losses[-1] < losses[0]
    return [r[4] for r in results]


def test_a_tied_weight_read_in_another_modules_forward_trains_as_plain_pytorch():
    # DeepSpeed gathers it on access and makes it an external parameter of the module running (the head)
    externals = _check_tied(spawn(tied, world_size=2, args=(False, False)))
    assert externals == [["Head"], ["Head"]]


def test_a_tied_weight_read_in_the_parents_forward_of_a_model_built_under_init():
    externals = _check_tied(spawn(tied, world_size=2, args=(True, True)))
    assert externals == [["Tied"], ["Tied"]]


def evaluate_tied(rank, world_size):
    torch.manual_seed(0)
    reference = Tied()
    model = copy.deepcopy(reference)
    zero = ds_zero.ZeroInference(model, config=STAGE3)
    with torch.no_grad():
        equal = [torch.equal(model(_tokens(step, rank)), reference(_tokens(step, rank))) for step in range(2)]
    held = [p.numel() for p in model.parameters()]
    zero.close()
    return equal, held


def test_a_tied_weight_read_in_another_modules_forward_without_an_optimizer():
    for equal, held in spawn(evaluate_tied, world_size=2):
        assert equal == [True, True] and held == [0, 0, 0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_init_without_a_process_group_starts_one_from_the_environment_on_two_ranks():
    script = textwrap.dedent("""
        import torch, ds_comm, ds_zero
        assert not ds_comm.is_initialized()
        torch.manual_seed(0)
        with ds_zero.Init():
            layer = torch.nn.Linear(5, 3)
        w = layer.weight
        print("RESULT", ds_comm.get_rank(), ds_comm.get_world_size(), w.numel(), w.ds_tensor.tolist(), flush=True)
        ds_comm.barrier()
    """)
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, "-c", script], text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(r),
                                   "LOCAL_RANK": str(r), "WORLD_SIZE": "2"}) for r in range(2)]
    outputs = [p.communicate(timeout=180) for p in procs]
    torch.manual_seed(0)
    weight = nn.Linear(5, 3).weight.detach()
    for rank, (proc, (stdout, stderr)) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, stderr[-3000:]
        line = next(line for line in stdout.splitlines() if line.startswith("RESULT"))
        _, got_rank, world, numel, shard = line.split(" ", 4)
        assert (int(got_rank), int(world), int(numel)) == (rank, 2, 0)
        assert torch.equal(torch.tensor(eval(shard)), _deepspeed_shard(weight, rank, 2))


def test_zero_param_status_is_deepspeeds_enum():
    assert [(s.name, s.value) for s in ds_zero.ZeroParamStatus] == [("AVAILABLE", 1), ("NOT_AVAILABLE", 2),
                                                                   ("INFLIGHT", 3)]
