"""CPU-Adam against torch's Adam, side by side in one process (issue: "at the memory-bandwidth limit"),
and the fp16 loss-scaling step: ``ds_ops.adam_step`` with ``grad_scale`` against torch's ways.

fp32 parameters, 2 threads (torch.set_num_threads), sizes 10M and 100M elements in one tensor and
100M in 100 tensors. For each optimizer: median ms per step, ns per parameter, and the effective
bandwidth at 28 bytes per parameter per step (read p, g, m, v; write p, m, v; 20 bytes with bf16
m and v) as a fraction of this machine's in-place read-modify-write bandwidth, measured here with
`b[i] += s * c[i]` (OpenMP, same threads), built by the ds-ops op builder.

Loss scaling (``--only loss-scale``; one flat fp32 partition, steps interleaved, medians): CPUAdam's
update (no scale, no check), our ``adam_step`` with ``grad_scale=1`` and ``1024`` and
``check_finite=False`` (the unscaling is one multiply in the same pass: the ratios should be 1.00),
with its overflow check (a read-only pass over the gradients first),
against torch's ``_fused_adamw_`` alone, ``_foreach_div_`` + ``_fused_adamw_`` (unscale pass, then
the step), and what ``GradScaler`` does with a fused optimizer (``_amp_foreach_non_finite_check_and_unscale_``
as the inf check, then ``_fused_adamw_(grad_scale=, found_inf=)``). Gradients are restored from a
copy before every step (untimed), so repeated unscaling never drifts into denormals.

``--only interleaved``: ``CPUAdam`` against ``torch.optim.Adam(fused=True)``, each on its own copy of
the parameters (one tensor per size), stepping in turn, ours then torch's, ``--repeats`` rounds: the
medians, their ratio and the median of the per-round ratios (the speed of ours relative to torch's:
above 1 is faster). Machine drift hits both alike.

    python benchmarks/bench_adam.py [--sizes 10M,100M] [--repeats 5]
                                    [--only all|optimizers|loss-scale|interleaved] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

import ds_ops
from ds_ops.op_builder import OpBuilder

THREADS = 2


class RmwBandwidthBuilder(OpBuilder):
    NAME = "bench_rmw"
    DESCRIPTION = "benchmark-only: in-place read-modify-write bandwidth"

    def sources(self):
        return [Path(__file__).resolve().parent / "rmw_bandwidth.cpp"]

    def include_dirs(self):
        return []


def rmw_bandwidth(n: int, repeats: int) -> float:
    """Bytes per second of b[i] += s * c[i] over two float32 arrays of n elements."""
    kernel = RmwBandwidthBuilder().load()
    b, c = torch.ones(n), torch.full((n,), 2.0)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        kernel.rmw(b.data_ptr(), c.data_ptr(), n, 0.5, THREADS)
        times.append(time.perf_counter() - start)
    return 12 * n / statistics.median(times[1:])


def make_params(total: int, tensors: int) -> list[torch.Tensor]:
    size = total // tensors
    params = []
    for _ in range(tensors):
        p = torch.randn(size)
        p.grad = torch.randn(size)
        params.append(p)
    return params


OPTIMIZERS = {
    "ds CPUAdam": (lambda ps: ds_ops.CPUAdam(ps, lr=1e-3), 28),
    "ds FusedAdam": (lambda ps: ds_ops.FusedAdam(ps, lr=1e-3), 28),
    "ds CPUAdam bf16 states": (lambda ps: ds_ops.CPUAdam(ps, lr=1e-3, state_dtype=torch.bfloat16), 20),
    "torch Adam (foreach)": (lambda ps: torch.optim.Adam(ps, lr=1e-3), 28),
    "torch Adam (fused)": (lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True), 28),
}


def bench_interleaved(n: int, repeats: int) -> dict:
    """CPUAdam and torch's fused Adam stepping in turn on two copies of n parameters (fp32, one tensor)."""
    ours_p, torch_p = make_params(n, 1), make_params(n, 1)
    ours, theirs = ds_ops.CPUAdam(ours_p, lr=1e-3), torch.optim.Adam(torch_p, lr=1e-3, fused=True)
    ours.step()  # creates the states, pages in every buffer
    theirs.step()
    times = {"ds CPUAdam": [], "torch Adam (fused)": []}
    for _ in range(repeats):
        for name, optimizer in (("ds CPUAdam", ours), ("torch Adam (fused)", theirs)):
            start = time.perf_counter()
            optimizer.step()
            times[name].append(time.perf_counter() - start)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    per_round = statistics.median(t / o for o, t in zip(times["ds CPUAdam"], times["torch Adam (fused)"], strict=True))
    speed = ms["torch Adam (fused)"] / ms["ds CPUAdam"]
    print(f"\n{n / 1e6:.0f}M fp32 parameters, CPUAdam and torch Adam(fused=True) in turn, {repeats} rounds "
          f"(simd {ds_ops.op_builder.CPUAdamBuilder().load().simd_level()})")
    for name, value in ms.items():
        print(f"  {name:<24}{value:>10.1f} ms (median)   {28 * n / (value / 1e3) / 1e9:>6.1f} GB/s")
    print(f"  CPUAdam speed relative to torch fused: {speed:.3f}x (ratio of medians), {per_round:.3f}x (median of "
          f"per-round ratios)")
    return {"params": n, "ms": ms, "speed_ratio": speed, "per_round_speed_ratio": per_round}


def time_steps(optimizer, repeats: int) -> float:
    optimizer.step()  # creates the state
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def loss_scale_cases(n: int):
    """name -> (prepare, step): prepare runs untimed before each timed step."""
    p, g, m, v = torch.randn(n), torch.randn(n) * 1024, torch.zeros(n), torch.zeros(n)
    saved = g.clone()
    tp, tm, tv, steps = [p.clone()], [torch.zeros(n)], [torch.zeros(n)], [torch.tensor(1.0)]
    tg = [g.clone()]
    scale, found_inf = torch.tensor(1024.0), torch.zeros(1)

    def restore():
        tg[0].copy_(saved)

    def fused(**kwargs):
        torch._fused_adamw_(tp, tg, tm, tv, [], steps, lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8,
                            amsgrad=False, maximize=False, **kwargs)

    def foreach_div_then_fused():
        torch._foreach_div_(tg, 1024.0)
        fused()

    def grad_scaler_then_fused():
        found_inf.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(tg, found_inf, torch.ones(1))  # GradScaler's inf check
        fused(grad_scale=scale, found_inf=found_inf)

    def ours(grad_scale, check_finite):
        return lambda: ds_ops.adam_step(p, g, m, v, 1, 1e-3, weight_decay=0.01, grad_scale=grad_scale,
                                        check_finite=check_finite)

    plain = torch.randn(n)
    plain.grad = torch.randn(n)
    cpu_adam = ds_ops.CPUAdam([plain], lr=1e-3, weight_decay=0.01)

    return {
        "ds CPUAdam (no scale, no check)": (restore, cpu_adam.step),
        "ds adam_step scale 1": (restore, ours(1.0, False)),
        "ds adam_step scale 1024": (restore, ours(1024.0, False)),
        "ds adam_step 1024 + inf check": (restore, ours(1024.0, True)),
        "torch fused AdamW": (restore, fused),
        "torch foreach_div_ + fused": (restore, foreach_div_then_fused),
        "torch fused(grad_scale)": (restore, lambda: fused(grad_scale=scale)),
        "torch GradScaler check + fused": (restore, grad_scaler_then_fused),
    }


def bench_loss_scale(n: int, repeats: int, limit: float) -> dict:
    cases = loss_scale_cases(n)
    times = {name: [] for name in cases}
    for prepare, step in cases.values():  # warm-up: page in every buffer
        prepare()
        step()
    for _ in range(repeats):
        for name, (prepare, step) in cases.items():
            prepare()
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(f"\nloss scaling, {n / 1e6:.0f}M parameters in one flat partition (interleaved, median of {repeats})")
    print(f"  {'step':<34}{'ms/step':>10}{'GB/s at 28 B/param':>20}{'of limit':>10}")
    for name, value in ms.items():
        bandwidth = 28 * n / (value / 1e3)
        print(f"  {name:<34}{value:>10.1f}{bandwidth / 1e9:>20.1f}{bandwidth / limit:>9.0%}")
    ours, ours1 = ms["ds adam_step scale 1024"], ms["ds adam_step scale 1"]
    ratios = {
        "ours scale 1024 / scale 1 (same pass)": ours / ours1,
        "ours scale 1024 / CPUAdam's unscaled update": ours / ms["ds CPUAdam (no scale, no check)"],
        "ours with inf check / scale 1": ms["ds adam_step 1024 + inf check"] / ours1,
        "torch foreach_div_ + fused / fused alone": ms["torch foreach_div_ + fused"] / ms["torch fused AdamW"],
        "torch GradScaler check + fused / fused alone": ms["torch GradScaler check + fused"] / ms["torch fused AdamW"],
        "speed-up, ours scale 1024 over torch foreach_div_ + fused": ms["torch foreach_div_ + fused"] / ours,
        "speed-up, ours with inf check over torch GradScaler check + fused":
            ms["torch GradScaler check + fused"] / ms["ds adam_step 1024 + inf check"],
    }
    for name, value in ratios.items():
        print(f"  {name}: {value:.2f}x")
    return {"params": n, "ms": ms, "ratios": ratios}


def parse_size(text: str) -> int:
    text = text.strip().upper()
    return int(float(text[:-1]) * 1_000_000) if text.endswith("M") else int(text)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="10M,100M")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", choices=("all", "optimizers", "loss-scale", "interleaved"), default="all")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.only == "interleaved":
        rows = [bench_interleaved(n, args.repeats) for n in sizes]
        if args.json_path:
            Path(args.json_path).write_text(json.dumps({"bench": "adam-interleaved", "threads": THREADS,
                                                        "results": rows}, indent=2))
        return
    cases = [(n, 1) for n in sizes] + [(n, 100) for n in sizes if n >= 100_000_000]
    limit = rmw_bandwidth(max(sizes), args.repeats)
    print(f"bench_adam: {THREADS} threads, median of {args.repeats} steps; read-modify-write limit "
          f"b[i] += s*c[i]: {limit / 1e9:.1f} GB/s")
    results, loss_scale = [], []
    if args.only == "loss-scale":
        cases = []
    for n, tensors in cases:
        params = make_params(n, tensors)
        print(f"\n{n / 1e6:.0f}M parameters in {tensors} tensor(s)")
        print(f"  {'optimizer':<24}{'ms/step':>10}{'ns/param':>10}{'GB/s':>8}{'of limit':>10}")
        row = {"params": n, "tensors": tensors}
        for name, (make, bytes_per_param) in OPTIMIZERS.items():
            optimizer = make(params)
            seconds = time_steps(optimizer, args.repeats)
            del optimizer
            gc.collect()
            bandwidth = bytes_per_param * n / seconds
            row[name] = {"ms": seconds * 1e3, "ns_per_param": seconds * 1e9 / n,
                         "GBps": bandwidth / 1e9, "fraction_of_limit": bandwidth / limit}
            print(f"  {name:<24}{seconds * 1e3:>10.1f}{seconds * 1e9 / n:>10.3f}{bandwidth / 1e9:>8.1f}"
                  f"{bandwidth / limit:>9.0%}")
        ours = row["ds CPUAdam"]["ms"]
        for baseline in ("torch Adam (fused)", "torch Adam (foreach)"):
            print(f"  speed-up of ds CPUAdam over {baseline}: {row[baseline]['ms'] / ours:.2f}x")
        print(f"  speed-up of bf16 states over fp32 CPUAdam: {ours / row['ds CPUAdam bf16 states']['ms']:.2f}x")
        results.append(row)
        del params
        gc.collect()
    if args.only != "optimizers":
        for n in sizes:
            loss_scale.append(bench_loss_scale(n, args.repeats, limit))
            gc.collect()
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"bench": "adam", "threads": THREADS, "rmw_limit_GBps": limit / 1e9,
                                                    "results": results, "loss_scale": loss_scale}, indent=2))


if __name__ == "__main__":
    main()
