"""ds-zero against DDP, torch's ZeroRedundancyOptimizer and FSDP2 on the engine workload of ARCHITECTURE.md, 'The yardstick workload'.

A GPT-style pre-LN decoder (vocab 8192, d_model 512, 8 layers, 8 heads, sequence 256, untied LM
head, no dropout: about 34M parameters), micro-batch 4 per rank, synthetic tokens, 2 ranks x 1
thread on gloo, AdamW. Each configuration runs in fresh rank processes (so peak RSS is its own);
time per step is the median of steps 3..N. Prints time per step, the ratio to DDP, model-state
bytes and peak RSS per rank; ``--json PATH`` writes the same figures.

    python benchmarks/bench_zero.py [--steps 20] [--gas 1 4] [--precision fp32 bf16] [--rounds 1] [--json out.json]
    python benchmarks/bench_zero.py --interleaved --kinds ddp fsdp2 zero-3 zero-3-offload --steps 12

bf16: DDP runs the float32 model under ``torch.autocast("cpu", torch.bfloat16)`` (what a PyTorch user
would do); ds-zero runs the model in bfloat16 with a float32 master copy (``bf16.enabled``), as
DeepSpeed does. ``zero-2-offload`` is stage 2 with ``offload_optimizer.device: cpu``; ``fsdp2`` is
``fully_shard`` on each block and on the model with torch's AdamW (what a user would pick instead of
ZeRO-3); ``zero-3-offload`` offloads parameters and optimizer to the CPU, ``zero-3-nvme`` puts the
optimizer's states on disk (``--nvme-path``, 1M-element sub-groups, pipelined reads and writes);
``zero-3-keep`` is stage 3 with DeepSpeed's defaults, whose reuse distance (1e9 elements) keeps every
unit gathered from its forward to its backward (half the gathers, more memory).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _yardstick import GPT, Shape, tokens

import ds_comm
from ds_comm.testing import spawn
from ds_zero import ZeroOptimizer

SHAPE = Shape()  # the yardstick's sizes (_yardstick.py, its one definition)


def _tokens(step: int, micro: int, rank: int) -> torch.Tensor:
    return tokens(step, micro, rank, SHAPE)


def _state_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t) and t.dim() > 0)


def _build(rank: int, world_size: int, kind: str, gas: int, bucket: int | None, precision: str,
           nvme_path: str | None):
    """A fresh model trained the way ``kind`` says: its ``train_step(step)`` and ``state()`` (bytes)."""
    torch.manual_seed(0)
    model = GPT()
    adamw = {"lr": 1e-4, "weight_decay": 0.01}
    bf16 = precision == "bf16"
    if kind == "ddp" or kind == "torch-zero1":
        ddp = nn.parallel.DistributedDataParallel(model)
        if kind == "ddp":
            optimizer = torch.optim.AdamW(ddp.parameters(), **adamw)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, **adamw)

        def train_step(step):
            for micro in range(gas):
                context = ddp.no_sync() if micro < gas - 1 else torch.enable_grad()
                with context:
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                        loss = ddp(_tokens(step, micro, rank)) / gas
                    loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)

        def state() -> int:
            params = list(model.parameters())
            states = [t for s in optimizer.optim.state.values() for t in s.values()] if kind == "torch-zero1" else \
                [t for s in optimizer.state.values() for t in s.values()]
            return _state_bytes(params) + _state_bytes(p.grad for p in params) + _state_bytes(states)
    elif kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
            MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), **adamw)

        def train_step(step):
            for micro in range(gas):
                model.set_requires_gradient_sync(micro == gas - 1)
                loss = model(_tokens(step, micro, rank)) / gas
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        def local(tensors):
            return [t.to_local() if hasattr(t, "to_local") else t for t in tensors if t is not None]

        def state() -> int:
            params = list(model.parameters())
            states = [t for s in optimizer.state.values() for t in s.values()]
            return _state_bytes(local(params)) + _state_bytes(local(p.grad for p in params)) + \
                _state_bytes(local(states))
    else:
        stage = int(kind.removeprefix("zero-").removesuffix("-offload").removesuffix("-nvme").removesuffix("-keep"))
        config = {"stage": stage} if bucket is None else {"stage": stage, "reduce_bucket_size": bucket}
        if kind.endswith("-nvme"):  # the optimizer's states on disk, 1M-element chunks, I/O overlapped
            config["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "pipeline_read": True,
                                           "pipeline_write": True}
            config["offload_param"] = {"device": "cpu"}
            config["sub_group_size"] = 1_000_000
        if kind.endswith("-offload"):
            config["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
            if stage == 3:
                config["offload_param"] = {"device": "cpu", "pin_memory": True}
        if stage == 3 and not kind.endswith("-keep"):  # -keep: DeepSpeed's defaults (see STAGE3)
            config.update(STAGE3)
        zero = ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs=adamw, config=config,
                             gradient_accumulation_steps=gas, bf16={"enabled": bf16})

        def train_step(step):
            for micro in range(gas):
                zero.backward(model(_tokens(step, micro, rank)))
                zero.step()
                zero.zero_grad()

        def state() -> int:
            b = zero.memory_bytes()
            return b["params"] + b["grads"] + b["master"] + b["optimizer"]
    return train_step, state


def run(rank: int, world_size: int, kind: str, gas: int, steps: int, bucket: int | None, precision: str,
        nvme_path: str | None = None) -> dict:
    torch.set_num_threads(1)
    train_step, state = _build(rank, world_size, kind, gas, bucket, precision, nvme_path)
    times = []
    for step in range(steps):
        ds_comm.barrier()
        start = time.perf_counter()
        train_step(step)
        times.append(time.perf_counter() - start)
    return {"times": times, "state_bytes": state(),
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def run_interleaved(rank: int, world_size: int, kinds: list[str], gas: int, steps: int, precision: str,
                    nvme_path: str | None) -> dict[str, list[float]]:
    """Every configuration on its own copy of the model in one process pair, their steps alternating
    (the order rotating each step): drift hits them all alike."""
    torch.set_num_threads(1)
    built = {kind: _build(rank, world_size, kind, gas, None, precision, nvme_path)[0] for kind in kinds}
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for step in range(steps):
        for kind in kinds[step % len(kinds):] + kinds[:step % len(kinds)]:
            ds_comm.barrier()
            start = time.perf_counter()
            built[kind](step)
            times[kind].append(time.perf_counter() - start)
    return times


def interleaved(args: argparse.Namespace) -> None:
    """``--interleaved``: the median over steps 3.. of each configuration's time / DDP's in the same step."""
    kinds = ["ddp", *[k for k in args.kinds if k != "ddp"]]
    scratch = tempfile.TemporaryDirectory(prefix="bench_zero_nvme_")
    for precision in args.precision:
        results = spawn(run_interleaved, world_size=2, args=(kinds, args.gas[0], args.steps, precision,
                                                             args.nvme_path or scratch.name), timeout=3600)
        per_step = {k: [max(r[k][i] for r in results) for i in range(args.steps)][2:] for k in kinds}
        rows = [{"precision": precision, "kind": k, "s_per_step": statistics.median(per_step[k]),
                 "ratio_to_ddp": statistics.median(a / b for a, b in zip(per_step[k], per_step["ddp"], strict=True))}
                for k in kinds]
        print(f"\ninterleaved, {precision}, gas {args.gas[0]}, steps 3..{args.steps} (the ratio: median of same-step "
              "ratios)\n| config | s/step | vs DDP |\n|---|---|---|")
        for row in rows:
            print(f"| {row['kind']} | {row['s_per_step']:.3f} | {row['ratio_to_ddp']:.3f}x |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"mode": "interleaved", "steps": args.steps, "rows": rows}, f, indent=2)


KINDS = ["ddp", "torch-zero1", "zero-0", "zero-1", "zero-2", "zero-2-offload", "fsdp2", "zero-3", "zero-3-offload",
         "zero-3-nvme", "zero-3-keep"]
# Stage 3 as a user short of memory sets it (FSDP2's behaviour): a unit is released after its
# forward (DeepSpeed's default reuse distance, 1e9 elements, keeps the whole model of this size
# gathered from forward to backward), and about one block (3.1M elements) is gathered ahead.
STAGE3 = {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 4_000_000}


def bf16_matmul_slowdown() -> float:
    """How much slower a bfloat16 matmul of the workload's shape runs than a float32 one on one
    thread: about 0.5-1x on CPUs with native bf16 (AVX512-BF16, AMX); on AVX2-only CPUs torch
    falls back to a scalar kernel, over 100x slower, and no bf16 training is worth timing there."""
    torch.set_num_threads(1)
    seconds = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(256, 512, dtype=dtype), torch.randn(512, 512, dtype=dtype)
        a @ b
        start = time.perf_counter()
        a @ b
        seconds[dtype] = time.perf_counter() - start
    return seconds[torch.bfloat16] / seconds[torch.float32]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--gas", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds over the configurations")
    parser.add_argument("--kinds", nargs="+", default=KINDS, choices=KINDS)
    parser.add_argument("--bucket", type=float, default=None, help="ds-zero's reduce_bucket_size (elements; "
                        "default: DeepSpeed's 5e8, one bucket for this model)")
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--nvme-path", default=None, help="directory for zero-3-nvme's optimizer states (default: "
                        "a temporary directory, removed afterwards)")
    parser.add_argument("--force-bf16", action="store_true", help="time bf16 even where bf16 matmuls are emulated")
    parser.add_argument("--interleaved", action="store_true", help="every configuration in one process pair, steps "
                        "alternating: ratios to DDP free of this machine's drift (no peak RSS: shared processes)")
    args = parser.parse_args()
    if args.steps < 4:
        parser.error("--steps must be >= 4 (steps 3.. are timed)")
    slowdown = bf16_matmul_slowdown()
    if "bf16" in args.precision and slowdown > 8 and not args.force_bf16:
        print(f"bf16 rows skipped: a bf16 matmul runs {slowdown:.0f}x slower than float32 on this CPU (no native "
              "bf16: torch emulates it), so both DDP under autocast and ds-zero would time the emulation; "
              "--force-bf16 times them anyway", flush=True)
        args.precision = [p for p in args.precision if p != "bf16"]
    if args.interleaved:
        interleaved(args)
        return
    psi = sum(p.numel() for p in GPT().parameters())
    print(f"GPT {psi / 1e6:.1f}M parameters, micro-batch {SHAPE.micro_batch}x{SHAPE.seq}, 2 ranks x 1 thread, gloo, "
          f"AdamW; {args.steps} steps, median of steps 3..{args.steps}, {args.rounds} round(s); ds-zero "
          f"reduce_bucket_size {'5e8 (default)' if args.bucket is None else f'{args.bucket:g}'}", flush=True)
    rows = []
    scratch = tempfile.TemporaryDirectory(prefix="bench_zero_nvme_") if args.nvme_path is None else None
    nvme_path = args.nvme_path or scratch.name
    for precision in args.precision:
        for gas in args.gas:
            medians: dict[str, list[float]] = {k: [] for k in args.kinds}
            extra: dict[str, dict] = {}
            for r in range(args.rounds):
                # interleaved: each round runs every configuration once, starting one further along
                # (this machine drifts within minutes, so no configuration always runs first or last)
                for kind in args.kinds[r % len(args.kinds):] + args.kinds[:r % len(args.kinds)]:
                    bucket = None if args.bucket is None else int(args.bucket)
                    results = spawn(run, world_size=2, args=(kind, gas, args.steps, bucket, precision, nvme_path),
                                    timeout=3600)
                    per_step = [max(r["times"][i] for r in results) for i in range(args.steps)]
                    medians[kind].append(statistics.median(per_step[2:]))
                    extra[kind] = {"state_bytes": max(r["state_bytes"] for r in results),
                                   "peak_rss": max(r["peak_rss"] for r in results)}
                    print(f"  {precision} gas {gas} {kind:<14} {medians[kind][-1]:.3f} s/step", flush=True)
            base = statistics.median(medians["ddp"]) if "ddp" in medians else None
            for kind in args.kinds:
                seconds = statistics.median(medians[kind])
                rows.append({"precision": precision, "gas": gas, "kind": kind, "s_per_step": seconds,
                             "ratio_to_ddp": seconds / base if base else None, **extra[kind]})
    print(f"\n{'prec':<5} {'gas':>3} {'config':<14} {'s/step':>8} {'vs DDP':>7} {'state MiB/rank':>15} {'B/param':>8} "
          f"{'peak RSS MiB/rank':>18}")
    for row in rows:
        ratio = f"{row['ratio_to_ddp']:.3f}x" if row["ratio_to_ddp"] else "-"
        print(f"{row['precision']:<5} {row['gas']:>3} {row['kind']:<14} {row['s_per_step']:>8.3f} {ratio:>7} "
              f"{row['state_bytes'] / 2**20:>15.1f} {row['state_bytes'] / psi:>8.2f} {row['peak_rss'] / 2**20:>18.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"parameters": psi, "steps": args.steps, "rounds": args.rounds, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
