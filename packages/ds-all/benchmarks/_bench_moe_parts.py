"""The MoE benchmark's workload and its engine runner (``bench_moe.py`` uses them; see its docstring).

This file imports torch only at module level, so that the same model code runs under DeepSpeed 0.19.8's
venv and under ds-all: ``build_gpt`` takes the MoE class to use (``deepspeed.moe.layer.MoE`` or
``ds_moe.MoE``), and ``python _bench_moe_parts.py --backend deepspeed|ds_all ...`` (under ``torchrun``) trains
it through that backend's ``initialize`` with one config dict and writes each rank's step times to JSON.

The model: ARCHITECTURE.md's yardstick GPT (pre-LN decoder, untied head, no dropout) whose every block's MLP
is either dense (``d_model -> hidden -> d_model``, GELU) or an MoE layer of ``num_experts`` copies of the
usual MLP (``d_model -> 4 d_model -> d_model``), top-``k`` gated. The forward returns ``(cross entropy, sum of
the layers' l_aux)`` and keeps each MoE layer's ``exp_counts`` in ``model.exp_counts``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

ADAMW = {"lr": 1e-4, "weight_decay": 0.01}


@dataclass(frozen=True)
class Shape:
    vocab: int = 8192
    d_model: int = 512
    layers: int = 8
    heads: int = 8
    seq: int = 256
    micro_batch: int = 4


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


class Block(nn.Module):
    def __init__(self, shape: Shape, moe: Moe, moe_cls) -> None:
        super().__init__()
        d = shape.d_model
        self.heads = shape.heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
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
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(attn)
        if self.moe is None:
            return x + self.mlp(self.ln2(x)), None, None
        out, l_aux, exp_counts = self.moe(self.ln2(x))
        return x + out, l_aux, exp_counts


class GPT(nn.Module):
    def __init__(self, shape: Shape, moe: Moe, moe_cls=None) -> None:
        super().__init__()
        self.shape = shape
        self.tok, self.pos = nn.Embedding(shape.vocab, shape.d_model), nn.Embedding(shape.seq, shape.d_model)
        self.blocks = nn.ModuleList(Block(shape, moe, moe_cls) for _ in range(shape.layers))
        self.norm, self.head = nn.LayerNorm(shape.d_model), nn.Linear(shape.d_model, shape.vocab, bias=False)
        self.exp_counts: list[torch.Tensor] = []

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        aux = x.new_zeros(())
        self.exp_counts = []
        for block in self.blocks:
            x, l_aux, exp_counts = block(x)
            if l_aux is not None:
                aux = aux + l_aux
                self.exp_counts.append(exp_counts.detach())
        logits = self.head(self.norm(x))
        ce = F.cross_entropy(logits[:, :-1].reshape(-1, self.shape.vocab), tokens[:, 1:].reshape(-1))
        return ce, aux


def build_gpt(shape: Shape, moe: Moe, moe_cls=None, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(shape, moe, moe_cls)


def tokens(shape: Shape, step: int, rank: int, skew: float = 0.0) -> torch.Tensor:
    """Micro-batch ``[micro_batch, seq]`` of step ``step`` on ``rank`` (fixed seed). ``skew == 0``: uniform random
    tokens. ``skew > 0``: a skewed, learnable stream: tokens at even positions drawn from a Zipf law of exponent
    ``skew`` over the vocabulary, each odd position a fixed random function of the token before it."""
    g = torch.Generator().manual_seed(100_000 * step + rank)
    b, s, v = shape.micro_batch, shape.seq, shape.vocab
    if skew <= 0:
        return torch.randint(0, v, (b, s), generator=g)
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
