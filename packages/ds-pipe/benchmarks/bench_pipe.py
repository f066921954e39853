"""ds-pipe's schedules against data parallelism and torch.distributed.pipelining on the workload of ARCHITECTURE.md, 'The yardstick workload'.

A GPT-style pre-LN decoder (vocab 8192, d_model 512, 8 layers, 8 heads, sequence 256, untied head:
about 34M parameters) as 10 layers (embedding, 8 blocks, norm + head), 2 ranks x 1 thread on gloo,
AdamW. Data parallel: DDP, micro-batch 4, gradient accumulation 4 (32 rows per step over both
ranks). Pipelines: 2 stages, micro-batch 4, 8 micro-batches (the same 32 rows per step). The stage
boundaries balance the layers' forward+backward times, measured once on one thread before the runs
(the embedding costs little, the head over a 8192 vocabulary about a block and a half).

Prints time per step (median of steps 3..N, each configuration in fresh processes, rounds
interleaved), the ratio to DDP, each stage's busy fraction (time in forward/backward passes over
the step) and the bubble each schedule predicts at these costs; ``--json PATH`` writes the figures.

    python benchmarks/bench_pipe.py [--steps 6] [--rounds 2] [--kinds ddp 1f1b ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

# the yardstick's one definition (ARCHITECTURE.md, "The yardstick workload"), from ds-zero's benchmarks folder by
# path: benchmarks are not installed, and this package gains no dependency on ds-zero
sys.path.append(str(Path(__file__).resolve().parents[2] / "ds-zero" / "benchmarks"))
import _yardstick as yardstick

import ds_comm
from ds_comm.testing import spawn
from ds_pipe import LayerSpec, PipelineExecutor, PipelineModule
from ds_pipe._module import partition_balanced

SHAPE = yardstick.Shape()  # vocab 8192, d_model 512, 8 layers, 8 heads, sequence 256, micro-batch 4
VOCAB, D_MODEL, LAYERS, SEQ, MICRO_BATCH = SHAPE.vocab, SHAPE.d_model, SHAPE.layers, SHAPE.seq, SHAPE.micro_batch
PIPE_MICRO_BATCHES, DP_GAS, STAGES = 8, 4, 2


# The yardstick GPT cut into pipeline layers: its blocks are the yardstick's own (``LayerSpec(yardstick.Block,
# ...)``); the embedding and the norm + head are the GPT's first and last modules as layers of their own (the
# yardstick's GPT is one module, and a pipeline stage builds only its layers), the loss its loss.
class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, D_MODEL), nn.Embedding(SEQ, D_MODEL)

    def forward(self, tokens):
        return self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.head = nn.LayerNorm(D_MODEL), nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, x):
        return self.head(self.norm(x))


def loss_fn(logits, tokens):
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def specs() -> list[LayerSpec]:
    blocks = [LayerSpec(yardstick.Block, SHAPE.d_model, SHAPE.heads) for _ in range(LAYERS)]
    return [LayerSpec(Embed), *blocks, LayerSpec(Head)]


def _tokens(step: int, micro: int, replica: int) -> torch.Tensor:
    return yardstick.tokens(step, micro, replica, SHAPE)


def layer_costs(repeats: int = 3) -> list[float]:
    """Forward+backward seconds of each layer on one thread (median of ``repeats``)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = _tokens(0, 0, 0)
    costs = []
    for i, spec in enumerate(specs()):
        layer = spec.build()
        times = []
        for _ in range(repeats):
            inp = x if i == 0 else x.detach().requires_grad_()
            start = time.perf_counter()
            out = layer(inp)
            (loss_fn(out, _tokens(0, 0, 0)) if i == LAYERS + 1 else out.float().square().mean()).backward()
            times.append(time.perf_counter() - start)
        costs.append(statistics.median(times))
        x = out.detach()
    return costs


def interleaved_bounds(costs: list[float]) -> list[int]:
    """Four parts (2 stages x 2 chunks) with the shortest estimated step: ``m`` times the busier stage's
    sum plus the bubble, about ``p - 1`` times the heaviest part (balancing the parts alone can leave
    one stage a block heavier; balancing the stages alone, one chunk five blocks long)."""
    def estimate(cuts):
        parts = [sum(costs[a:b]) for a, b in itertools.pairwise([0, *cuts, len(costs)])]
        return PIPE_MICRO_BATCHES * max(parts[0] + parts[2], parts[1] + parts[3]) + (STAGES - 1) * max(parts)
    return [0, *min(itertools.combinations(range(1, len(costs)), 3), key=estimate), len(costs)]


def _timed(steps, train_step):
    times = []
    for step in range(steps):
        ds_comm.barrier()
        start = time.perf_counter()
        busy = train_step(step)
        times.append((time.perf_counter() - start, busy))
    return times


def run(rank: int, world: int, kind: str, steps: int, bounds: dict) -> list:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    adamw = {"lr": 1e-4, "weight_decay": 0.01}
    if kind == "ddp":
        layers = [spec.build() for spec in specs()]
        model = nn.parallel.DistributedDataParallel(nn.Sequential(*layers))
        optimizer = torch.optim.AdamW(model.parameters(), **adamw)

        def train_step(step):
            for micro in range(DP_GAS):
                tokens = _tokens(step, micro, rank)
                with model.no_sync() if micro < DP_GAS - 1 else torch.enable_grad():
                    (loss_fn(model(tokens), tokens) / DP_GAS).backward()
            optimizer.step()
            optimizer.zero_grad()
            return None
        return _timed(steps, train_step)
    if kind.startswith("torch-"):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
        cut = bounds["1f1b"][1]
        mine = [spec.build() for spec in specs()][:cut] if rank == 0 else [spec.build() for spec in specs()][cut:]
        stage_module = nn.Sequential(*mine)
        stage = PipelineStage(stage_module, rank, STAGES, torch.device("cpu"))
        cls = Schedule1F1B if kind == "torch-1f1b" else ScheduleGPipe
        schedule = cls(stage, n_microbatches=PIPE_MICRO_BATCHES, loss_fn=loss_fn)
        optimizer = torch.optim.AdamW(stage_module.parameters(), **adamw)

        def train_step(step):
            tokens = torch.cat([_tokens(step, m, 0) for m in range(PIPE_MICRO_BATCHES)])
            if rank == 0:
                schedule.step(tokens)
            else:
                schedule.step(target=tokens)
            optimizer.step()
            optimizer.zero_grad()
            return None
        return _timed(steps, train_step)
    virtual = 2 if kind == "interleaved" else 1
    module = PipelineModule(specs(), num_stages=STAGES, loss_fn=loss_fn, partition_method=bounds[kind],
                            virtual_stages=virtual)
    executor = PipelineExecutor(module, torch.optim.AdamW(module.parameters(), **adamw),
                                micro_batches=PIPE_MICRO_BATCHES, schedule=kind)

    def train_step(step):
        data = [(t, t) for t in (_tokens(step, m, 0) for m in range(PIPE_MICRO_BATCHES))]
        executor.train_batch(iter(data))
        return executor.timings["busy"]
    return _timed(steps, train_step)


def predicted_ratio(kind: str) -> float:
    """The step time over the busy time that the schedule's simulation predicts at equal stage costs
    (forward 1, backward 2; zero-bubble's input and weight halves 1 each): 1 / (1 - bubble)."""
    from ds_pipe import InterleavedSchedule, TrainSchedule, ZeroBubbleSchedule
    from ds_pipe._simulate import simulate
    cls = {"1f1b": TrainSchedule, "interleaved": InterleavedSchedule, "zero_bubble": ZeroBubbleSchedule}[kind]
    kwargs = {"chunks": 2} if kind == "interleaved" else {}
    streams = [list(cls(PIPE_MICRO_BATCHES, STAGES, s, **kwargs).instructions()) for s in range(STAGES)]
    return 1 / (1 - simulate(streams, chunks=kwargs.get("chunks", 1)).bubble_fraction)


KINDS = ["ddp", "1f1b", "interleaved", "zero_bubble", "torch-1f1b", "torch-gpipe"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds over the configurations")
    parser.add_argument("--kinds", nargs="+", default=KINDS, choices=KINDS)
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be >= 3 (steps 3.. are timed)")
    costs = layer_costs()
    bounds = {"1f1b": partition_balanced(costs, STAGES), "zero_bubble": partition_balanced(costs, STAGES),
              "interleaved": interleaved_bounds(costs)}
    print("layer fwd+bwd ms: " + " ".join(f"{c * 1e3:.0f}" for c in costs))
    print(f"boundaries: 2 stages {bounds['1f1b']}, interleaved 4 parts {bounds['interleaved']}; "
          f"{PIPE_MICRO_BATCHES} micro-batches x {MICRO_BATCH} rows vs DDP 2 x {DP_GAS} x {MICRO_BATCH} rows", flush=True)
    medians: dict[str, list[float]] = {k: [] for k in args.kinds}
    busy: dict[str, list[float]] = {k: [] for k in args.kinds}
    for r in range(args.rounds):
        for kind in args.kinds[r % len(args.kinds):] + args.kinds[:r % len(args.kinds)]:
            results = spawn(run, world_size=2, args=(kind, args.steps, bounds), timeout=3600)
            per_step = [max(res[i][0] for res in results) for i in range(args.steps)]
            medians[kind].append(statistics.median(per_step[2:]))
            if results[0][0][1] is not None:
                busy[kind] = [statistics.median(res[i][1] / per_step[i] for i in range(2, args.steps))
                              for res in results]
            print(f"  round {r + 1} {kind:<12} {medians[kind][-1]:.3f} s/step", flush=True)
    base = statistics.median(medians["ddp"]) if "ddp" in medians else None
    rows = []
    print(f"\n{'config':<12} {'s/step':>8} {'vs DDP':>7} {'busy stage 0/1':>15} {'predicted':>10}")
    for kind in args.kinds:
        seconds = statistics.median(medians[kind])
        predicted = predicted_ratio(kind) if kind in bounds else None
        row = {"kind": kind, "s_per_step": seconds, "ratio_to_ddp": seconds / base if base else None,
               "busy": busy[kind] or None, "predicted_ratio": predicted}
        rows.append(row)
        ratio = f"{row['ratio_to_ddp']:.3f}x" if row["ratio_to_ddp"] else "-"
        shares = "/".join(f"{b:.0%}" for b in busy[kind]) if busy[kind] else "-"
        print(f"{kind:<12} {seconds:>8.3f} {ratio:>7} {shares:>15} "
              f"{(f'{predicted:.3f}x' if predicted else '-'):>10}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "rounds": args.rounds, "layer_costs": costs, "bounds": bounds,
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
