"""The engine against ds-zero used directly and against DDP, on ARCHITECTURE.md, 'The yardstick workload'.

The yardstick GPT (``packages/ds-zero/benchmarks/_yardstick.py``, imported from its folder: the one
definition of the workload), micro-batch 4 x 256 tokens per rank, 2 ranks x 1 thread on gloo,
AdamW (torch's, in all three). Per configuration, fresh rank processes; time per step is the median
of steps 3..N; each round runs every configuration, a stage's ds-zero and engine runs side by side in
alternating order; the table gives the median over rounds, and for the engine also the median of its
same-round ratio to ds-zero (the figure to read: the machine drifts between rounds). Also timed: ``initialize()`` (process group, ZeRO's buffers,
optimizer, schedule) against DDP's setup (process group, ``DistributedDataParallel``, AdamW), both
after imports, with the model built ("warm": nothing compiled or downloaded).

    python benchmarks/bench_engine.py [--steps 12] [--stage 0 1 2] [--gas 1] [--rounds 3] [--json out.json]
    python benchmarks/bench_engine.py --interleaved [--steps 16]   # the engine's overhead alone, drift-free
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

# the workload's one definition (ARCHITECTURE.md, "The yardstick workload"), from ds-zero's benchmarks folder by
# path: benchmarks are not installed, and this package gains no dependency on ds-zero
sys.path.append(str(Path(__file__).resolve().parents[2] / "ds-zero" / "benchmarks"))
import _yardstick as yardstick

import ds_comm
from ds_comm.testing import spawn

ADAMW = {"lr": 1e-4, "weight_decay": 0.01}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(rank: int, world_size: int, kind: str, stage: int, gas: int, steps: int, port: int) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = yardstick.GPT()
    ds_comm.destroy_process_group()  # spawn made one; each kind times its own setup from none, on a new port
    os.environ["MASTER_PORT"] = str(port)
    import ds_all  # imports are not setup: torch is imported before DDP's timing too
    from ds_zero import ZeroOptimizer

    start = time.perf_counter()
    if kind == "ddp":
        ds_comm.init_distributed()
        ddp = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(ddp.parameters(), **ADAMW)
        setup = time.perf_counter() - start

        def train_step(step):
            for micro in range(gas):
                with ddp.no_sync() if micro < gas - 1 else torch.enable_grad():
                    (ddp(yardstick.tokens(step, micro, rank)) / gas).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
    elif kind == "zero":
        ds_comm.init_distributed()
        zero = ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs=ADAMW, config={"stage": stage},
                             gradient_accumulation_steps=gas)
        setup = time.perf_counter() - start

        def train_step(step):
            for micro in range(gas):
                zero.backward(model(yardstick.tokens(step, micro, rank)))
                zero.step()
                zero.zero_grad()
    else:
        config = {"train_micro_batch_size_per_gpu": yardstick.Shape().micro_batch, "gradient_accumulation_steps": gas,
                  "optimizer": {"type": "AdamW", "params": {**ADAMW, "torch_adam": True}},
                  "zero_optimization": {"stage": stage}, "steps_per_print": 10**9,
                  "gradient_clipping": 0}  # as ds-zero direct and DDP: no clipping (DeepSpeed's default is 1.0)
        engine, *_ = ds_all.initialize(model=model, config=config)
        setup = time.perf_counter() - start

        def train_step(step):
            for micro in range(gas):
                engine.backward(engine(yardstick.tokens(step, micro, rank)))
                engine.step()
    times = []
    for step in range(steps):
        ds_comm.barrier()
        begin = time.perf_counter()
        train_step(step)
        times.append(time.perf_counter() - begin)
    return {"times": times, "setup": setup}


def run_interleaved(rank: int, world_size: int, stage: int, gas: int, steps: int) -> dict:
    """The engine and ds-zero direct in one process pair on two copies of the model, their steps
    alternating (which goes first alternates too): each ratio compares two steps taken seconds apart, so
    the machine's drift between runs does not enter it."""
    import copy

    import ds_all
    from ds_zero import ZeroOptimizer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = yardstick.GPT()
    direct = copy.deepcopy(model)
    config = {"train_micro_batch_size_per_gpu": yardstick.Shape().micro_batch, "gradient_accumulation_steps": gas,
              "optimizer": {"type": "AdamW", "params": {**ADAMW, "torch_adam": True}},
              "zero_optimization": {"stage": stage}, "steps_per_print": 10**9,
              "gradient_clipping": 0}  # as ds-zero direct and DDP: no clipping (DeepSpeed's default is 1.0)
    engine, *_ = ds_all.initialize(model=model, config=config)
    zero = ZeroOptimizer(direct, torch.optim.AdamW, optimizer_kwargs=ADAMW, config={"stage": stage},
                         gradient_accumulation_steps=gas)

    def engine_step(step):
        for micro in range(gas):
            engine.backward(engine(yardstick.tokens(step, micro, rank)))
            engine.step()

    def zero_step(step):
        for micro in range(gas):
            zero.backward(direct(yardstick.tokens(step, micro, rank)))
            zero.step()
            zero.zero_grad()

    times = {"engine": [], "zero": []}
    for step in range(steps):
        order = [("engine", engine_step), ("zero", zero_step)][::1 if step % 2 == 0 else -1]
        for name, fn in order:
            ds_comm.barrier()
            begin = time.perf_counter()
            fn(step)
            times[name].append(time.perf_counter() - begin)
    return times


def interleaved(args: argparse.Namespace) -> None:
    print(f"interleaved: engine and ds-zero direct alternating steps in one process pair, gas {args.gas}, "
          f"{args.steps} steps each, ratios of adjacent steps from step 3", flush=True)
    rows = []
    for stage in args.stage:
        results = spawn(run_interleaved, world_size=2, args=(stage, args.gas, args.steps), timeout=3600)
        engine = [max(r["engine"][i] for r in results) for i in range(args.steps)]
        zero = [max(r["zero"][i] for r in results) for i in range(args.steps)]
        ratio = statistics.median(e / z for e, z in zip(engine[2:], zero[2:], strict=True))
        rows.append({"stage": stage, "engine_s": statistics.median(engine[2:]), "zero_s": statistics.median(zero[2:]),
                     "ratio": ratio})
        print(f"  stage {stage}: engine {rows[-1]['engine_s']:.3f} s/step, ds-zero {rows[-1]['zero_s']:.3f} s/step, "
              f"median ratio of adjacent steps {ratio:.3f}x (goal <= 1.02x: {'met' if ratio <= 1.02 else 'missed'})",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mode": "interleaved", "steps": args.steps, "gas": args.gas, "rows": rows}, f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--stage", type=int, nargs="+", default=[0, 1, 2], choices=[0, 1, 2])
    parser.add_argument("--gas", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the configurations")
    parser.add_argument("--interleaved", action="store_true",
                        help="the engine's overhead only: engine and ds-zero steps alternating in one process pair")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    if args.steps < 4:
        parser.error("--steps must be >= 4 (steps 3.. are timed)")
    if args.interleaved:
        interleaved(args)
        return
    kinds = ["ddp"] + [f"{k}-{s}" for s in args.stage for k in ("zero", "engine")]
    print(f"GPT of ARCHITECTURE.md's yardstick workload, 2 ranks x 1 thread, gloo, AdamW, gas {args.gas}; "
          f"{args.steps} steps, median of "
          f"steps 3..{args.steps}; {args.rounds} interleaved round(s)", flush=True)
    per_step: dict[str, list[float]] = {k: [] for k in kinds}
    setup: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(args.rounds):
        # each stage's ds-zero and engine runs are adjacent, in alternating order, so that their ratio
        # is taken within minutes (this machine drifts by 10-20 % over a round); DDP moves around them
        pairs = [[f"zero-{s}", f"engine-{s}"][::1 if r % 2 == 0 else -1] for s in args.stage]
        order = [kind for pair in pairs for kind in pair]
        order.insert(r % (len(order) + 1), "ddp")
        for kind in order:
            name, _, stage = kind.partition("-")
            results = spawn(run, world_size=2, args=(name, int(stage or 0), args.gas, args.steps, _free_port()),
                            timeout=3600)
            steps = [max(res["times"][i] for res in results) for i in range(args.steps)]
            per_step[kind].append(statistics.median(steps[2:]))
            # the rank that arrived last at the rendezvous: its time is not spent waiting for the other
            # rank to build its model
            setup[kind].append(min(res["setup"] for res in results))
            print(f"  round {r + 1} {kind:<9} {per_step[kind][-1]:.3f} s/step  setup {setup[kind][-1]:.2f} s", flush=True)
    rows = []
    ddp = statistics.median(per_step["ddp"])
    paired = {s: statistics.median(e / z for e, z in zip(per_step[f"engine-{s}"], per_step[f"zero-{s}"], strict=True))
              for s in args.stage}
    for kind in kinds:
        seconds = statistics.median(per_step[kind])
        name, _, stage = kind.partition("-")
        direct = statistics.median(per_step[f"zero-{stage}"]) if name == "engine" else None
        rows.append({"config": kind, "s_per_step": seconds, "vs_ddp": seconds / ddp,
                     "engine_vs_zero_direct": seconds / direct if direct else None,
                     "engine_vs_zero_paired": paired[int(stage)] if name == "engine" else None,
                     "setup_s": statistics.median(setup[kind])})
    print(f"\n{'config':<10} {'s/step':>8} {'vs DDP':>8} {'vs ds-zero direct':>18} {'same-round ratio':>17} "
          f"{'setup s':>8}")
    for row in rows:
        versus = f"{row['engine_vs_zero_direct']:.3f}x" if row["engine_vs_zero_direct"] else "-"
        pair = f"{row['engine_vs_zero_paired']:.3f}x" if row["engine_vs_zero_paired"] else "-"
        print(f"{row['config']:<10} {row['s_per_step']:>8.3f} {row['vs_ddp']:>7.3f}x {versus:>18} {pair:>17} "
              f"{row['setup_s']:>8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "rounds": args.rounds, "gas": args.gas, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
