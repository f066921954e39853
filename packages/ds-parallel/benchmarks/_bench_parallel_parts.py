"""bench_parallel's model and its torchrun runner (plain torch at import, so DeepSpeed's venv can run it too).

The GPT (pre-LN decoder, learned positions, tied nothing; its blocks are the yardstick's, ``_yardstick.py`` in
ds-zero's benchmarks, its sizes the yardstick's ``Shape``, ``micro_batch`` sequences) takes an
``attention(q, k, v)`` callable on ``[batch, seq, heads, head_dim]``, so the same module runs whole-sequence
attention on one rank, ds-parallel's ``DistributedAttention`` or DeepSpeed's. The runner (``--backend
ds|deepspeed``, under torchrun, 2 ranks) trains it with the sequence split over the ranks and writes each rank's
step times to ``<out>.rank<r>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

# the yardstick's one definition (ARCHITECTURE.md, "The yardstick workload"), from ds-zero's benchmarks folder by
# path: benchmarks are not installed, and this package gains no dependency on ds-zero
sys.path.append(str(Path(__file__).resolve().parents[2] / "ds-zero" / "benchmarks"))
import _yardstick as yardstick
from _yardstick import Shape

ULYSSES = Shape(d_model=256, layers=2, seq=8192, micro_batch=1)  # the whole sequence of one sample


def sdpa_causal(q, k, v):
    """Local attention on [batch, seq, heads, head_dim] (torch's SDPA: on CPU a flash kernel, O(seq) memory)."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=True).transpose(1, 2)


class Block(yardstick.Block):
    """The yardstick's block whose attention is ``attention(q, k, v)`` on ``[batch, seq, heads, head_dim]``."""

    def __init__(self, shape: Shape, attention):
        super().__init__(shape.d_model, shape.heads)
        self.attention = attention

    def attend(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        return x + self.proj(self.attention(q, k, v).reshape(b, s, d))


# Not the yardstick's GPT: a forward that takes this rank's positions and returns the logits (the sequence-parallel
# step computes the loss of its slice), the final norm named ``ln`` and an LM head with a bias, as measured so far.
class GPT(torch.nn.Module):
    def __init__(self, shape: Shape, attention):
        super().__init__()
        self.tok = torch.nn.Embedding(shape.vocab, shape.d_model)
        self.pos = torch.nn.Embedding(shape.seq, shape.d_model)
        self.blocks = torch.nn.ModuleList(Block(shape, attention) for _ in range(shape.layers))
        self.ln, self.head = torch.nn.LayerNorm(shape.d_model), torch.nn.Linear(shape.d_model, shape.vocab)

    def forward(self, tokens, first_position: int = 0, positions=None):
        if positions is None:  # this rank's contiguous slice of the sequence starts at first_position
            positions = torch.arange(first_position, first_position + tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def batch(shape: Shape, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(shape.vocab, (shape.micro_batch, shape.seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def average_gradients(model, world: int, all_reduce) -> None:
    """Average the gradients over the ranks with one all-reduce of a flat buffer (as a DDP bucket would)."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.flatten() for g in grads])
    all_reduce(flat)
    flat /= world
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def sp_step(model, optimizer, tokens, targets, rank: int, world: int, all_reduce) -> float:
    """One step with the sequence split over ``world`` ranks: this rank's slice (positions offset), its mean
    loss, gradients averaged over the sequence group (as ZeRO does over data x sequence), AdamW."""
    chunk = tokens.shape[1] // world
    mine = slice(rank * chunk, (rank + 1) * chunk)
    logits = model(tokens[:, mine], rank * chunk)
    loss = F.cross_entropy(logits.flatten(0, 1), targets[:, mine].flatten())
    del logits
    loss.backward()
    average_gradients(model, world, all_reduce)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def _run(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    shape = Shape(args.vocab, args.d_model, args.layers, args.heads, args.seq, args.micro_batch)
    if args.backend == "deepspeed":
        import deepspeed
        import deepspeed.comm as dist
        from deepspeed.sequence.layer import DistributedAttention

        deepspeed.init_distributed(dist_backend="gloo")
        all_reduce = dist.all_reduce
    else:
        import ds_comm
        from ds_parallel import DistributedAttention

        ds_comm.init_distributed()
        dist, all_reduce = ds_comm, ds_comm.all_reduce
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    attention = DistributedAttention(sdpa_causal, group)
    torch.manual_seed(0)
    model = GPT(shape, lambda q, k, v: attention(q, k, v, 0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times, losses = [], []
    for step in range(args.steps):
        tokens, targets = batch(shape, step)
        dist.barrier()
        start = time.perf_counter()
        losses.append(sp_step(model, optimizer, tokens, targets, rank, world, all_reduce))
        times.append(time.perf_counter() - start)
    with open(f"{args.out}.rank{rank}.json", "w") as f:
        json.dump({"backend": args.backend, "times": times, "losses": losses}, f)
    dist.barrier()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="bench_parallel's Ulysses runner (run under torchrun, 2 ranks)")
    p.add_argument("--backend", choices=("ds", "deepspeed"), required=True)
    p.add_argument("--out", required=True, help="JSON path prefix: <out>.rank<r>.json")
    p.add_argument("--steps", type=int, default=3)
    for name, value in asdict(ULYSSES).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    return p


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _run(parser().parse_args())
