"""The MoE benchmark's workload and its engine runner (``bench_moe.py`` uses them; see its docstring).

This file imports torch only at module level (and ``packages/ds-zero/benchmarks/_yardstick.py``, the yardstick,
which imports torch only), so that the same model code runs under DeepSpeed 0.19.8's venv and under ds-all:
``build_gpt`` takes the MoE class to use (``deepspeed.moe.layer.MoE`` or ``ds_moe.MoE``), and
``python _bench_moe_parts.py --backend deepspeed|ds_all ...`` (under ``torchrun``) trains it through that backend's
``initialize`` with one config dict and writes each rank's step times to JSON.

The model: ARCHITECTURE.md's yardstick GPT (pre-LN decoder, untied head, no dropout: ``_yardstick.py``'s, its
blocks subclassed) whose every block's MLP is either dense (``d_model -> hidden -> d_model``, GELU) or an MoE layer
of ``num_experts`` copies of the usual MLP (``d_model -> 4 d_model -> d_model``), top-``k`` gated. The forward
returns ``(cross entropy, sum of the layers' l_aux)`` and keeps each MoE layer's ``exp_counts`` in
``model.exp_counts``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

# the yardstick's one definition (ARCHITECTURE.md, "The yardstick workload"), from ds-zero's benchmarks folder by
# path: benchmarks are not installed, and this package gains no dependency on ds-zero
sys.path.append(str(Path(__file__).resolve().parents[2] / "ds-zero" / "benchmarks"))
import _yardstick as yardstick
from _yardstick import Shape

logger = logging.getLogger(__name__)

ADAMW = {"lr": 1e-4, "weight_decay": 0.01}


@dataclass(frozen=True)
class Moe:
    """How the blocks' MLPs are built: ``num_experts == 0`` is the dense MLP of ``hidden`` units."""

    num_experts: int = 8
    k: int = 2
    ep_size: int = 1
    hidden: int = 0  # dense MLP width (num_experts == 0); 0: k * the expert's 4 * d_model (same active FLOPs)
    capacity_factor: float = 1.0
    bias_update_speed: float = 0.0
    aux_coeff: float = 0.01


class Block(yardstick.Block):
    """The yardstick's block (its attention half) with the MLP that ``moe`` says: dense, or ``moe_cls``'s layer.
    Returns ``(x, l_aux, exp_counts)`` (``None, None`` for the dense MLP)."""

    def __init__(self, shape: Shape, moe: Moe, moe_cls) -> None:
        super().__init__(shape.d_model, shape.heads, mlp=False)
        d = shape.d_model
        if moe.num_experts == 0:
            hidden = moe.hidden or moe.k * 4 * d
            self.mlp, self.moe = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d)), None
        else:
            expert = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
            kwargs = {"bias_update_speed": moe.bias_update_speed} if moe.bias_update_speed else {}
            # DeepSpeed's MoE defaults otherwise (drop_tokens, use_rts, top2_2nd_expert_sampling, min_capacity 4)
            self.mlp, self.moe = None, moe_cls(hidden_size=d, expert=expert, num_experts=moe.num_experts,
                                               ep_size=moe.ep_size, k=moe.k, capacity_factor=moe.capacity_factor,
                                               **kwargs)

    def forward(self, x):
        x = self.attend(x)
        if self.moe is None:
            return x + self.mlp(self.ln2(x)), None, None
        out, l_aux, exp_counts = self.moe(self.ln2(x))
        return x + out, l_aux, exp_counts


class GPT(yardstick.GPT):
    """The yardstick GPT of these blocks; the forward returns ``(cross entropy, sum of the layers' l_aux)``."""

    def __init__(self, shape: Shape, moe: Moe, moe_cls=None) -> None:
        super().__init__(shape, block=lambda: Block(shape, moe, moe_cls))
        self.exp_counts: list[torch.Tensor] = []

    def forward(self, tokens):
        x = self.embed(tokens)
        aux = x.new_zeros(())
        self.exp_counts = []
        for block in self.blocks:
            x, l_aux, exp_counts = block(x)
            if l_aux is not None:
                aux = aux + l_aux
                self.exp_counts.append(exp_counts.detach())
        return self.loss(x, tokens), aux


def build_gpt(shape: Shape, moe: Moe, moe_cls=None, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(shape, moe, moe_cls)


def tokens(shape: Shape, step: int, rank: int, skew: float = 0.0) -> torch.Tensor:
    """Micro-batch ``[micro_batch, seq]`` of step ``step`` on ``rank`` (fixed seed). ``skew == 0``: the yardstick's
    uniform random tokens. ``skew > 0``: a skewed, learnable stream: tokens at even positions drawn from a Zipf
    law of exponent ``skew`` over the vocabulary, each odd position a fixed random function of the token before
    it."""
    if skew <= 0:
        return yardstick.tokens(step, 0, rank, shape)
    g = torch.Generator().manual_seed(100_000 * step + rank)
    b, s, v = shape.micro_batch, shape.seq, shape.vocab
    weights = torch.arange(1, v + 1, dtype=torch.float64).pow(-skew)
    out = torch.multinomial(weights, b * s, replacement=True, generator=g).view(b, s)
    successor = torch.randperm(v, generator=torch.Generator().manual_seed(12345))
    out[:, 1::2] = successor[out[:, 0:-1:2]]
    return out


def config(shape: Shape, stage: int, lr: float | None = None) -> dict:
    """The one config dict both engines get (``lr``: AdamW's, default 1e-4)."""
    adamw = {**ADAMW, "lr": lr} if lr else ADAMW
    return {"train_micro_batch_size_per_gpu": shape.micro_batch, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {**adamw, "torch_adam": True}},
            "zero_optimization": {"stage": stage}, "steps_per_print": 10**9, "gradient_clipping": 0.0,
            "wall_clock_breakdown": False}


def expert_param_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of this rank's expert parameters, bytes of its other parameters); an expert parameter is one
    marked ``allreduce = False`` (DeepSpeed's mark, ds-moe's too)."""
    expert = dense = 0
    for p in model.parameters():
        nbytes = p.numel() * p.element_size()
        if getattr(p, "allreduce", True):
            dense += nbytes
        else:
            expert += nbytes
    return expert, dense


# ---- the runner: one backend's engine under torchrun --------------------------------------------------------

def _wait_turn(path: str, name: str) -> None:
    """Poll the turn file until it names ``name`` (two jobs stepping in turn: see ``--turn``)."""
    while True:
        try:
            with open(path) as f:
                if f.read().strip() == name:
                    return
        except FileNotFoundError:
            pass
        time.sleep(0.002)


def _give_turn(path: str, name: str) -> None:
    with open(f"{path}.tmp", "w") as f:
        f.write(name)
    os.replace(f"{path}.tmp", path)


def _run_engine(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    shape = Shape(args.vocab, args.d_model, args.layers, args.heads, args.seq, args.micro_batch)
    moe = Moe(num_experts=args.num_experts, k=args.k, ep_size=args.ep)
    if args.backend == "deepspeed":
        import deepspeed
        from deepspeed.moe.layer import MoE

        deepspeed.init_distributed(dist_backend="gloo")
        initialize = deepspeed.initialize
    else:
        import ds_all
        import ds_comm
        from ds_moe import MoE

        ds_comm.init_distributed()
        initialize = ds_all.initialize
    rank = int(os.environ.get("RANK", "0"))
    model = build_gpt(shape, moe, MoE)
    engine, *_ = initialize(model=model, model_parameters=list(model.parameters()),
                            config=config(shape, args.stage))
    times, losses = [], []
    for step in range(args.steps):
        batch = tokens(shape, step, rank)
        if args.turn and rank == 0:
            _wait_turn(args.turn, args.backend)
        torch.distributed.barrier()
        start = time.perf_counter()
        ce, aux = engine(batch)
        engine.backward(ce + moe.aux_coeff * aux)
        engine.step()
        times.append(time.perf_counter() - start)
        losses.append(float(ce.detach()))
        if args.turn:
            torch.distributed.barrier()  # both ranks done: hand the machine to the other job
            if rank == 0:
                _give_turn(args.turn, args.peer)
    expert, dense = expert_param_bytes(model)
    with open(f"{args.out}.rank{rank}.json", "w") as f:
        json.dump({"backend": args.backend, "times": times, "losses": losses, "expert_bytes": expert,
                   "dense_bytes": dense, "shape": asdict(shape)}, f)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="bench_moe's engine runner (run under torchrun)")
    parser.add_argument("--backend", choices=["deepspeed", "ds_all"], required=True)
    parser.add_argument("--out", required=True, help="JSON path prefix: <out>.rank<r>.json")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--turn", help="a file naming the job whose turn it is: this job's rank 0 waits for its "
                                       "--backend name there before each step and writes --peer after it")
    parser.add_argument("--peer", help="the other job's --backend name (with --turn)")
    for name, default in asdict(Shape()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    return parser


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.basicConfig(level=logging.WARNING)
    _run_engine(_parser().parse_args())
