"""CPU-Adam against torch's Adam, side by side in one process (issue: "at the memory-bandwidth limit").

fp32 parameters, 2 threads (torch.set_num_threads), sizes 10M and 100M elements in one tensor and
100M in 100 tensors. For each optimizer: median ms per step, ns per parameter, and the effective
bandwidth at 28 bytes per parameter per step (read p, g, m, v; write p, m, v; 20 bytes with bf16
m and v) as a fraction of this machine's in-place read-modify-write bandwidth, measured here with
`b[i] += s * c[i]` (OpenMP, same threads), built by the ds-ops op builder.

    python benchmarks/bench_adam.py [--sizes 10M,100M] [--repeats 5] [--json out.json]
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


def time_steps(optimizer, repeats: int) -> float:
    optimizer.step()  # creates the state
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def parse_size(text: str) -> int:
    text = text.strip().upper()
    return int(float(text[:-1]) * 1_000_000) if text.endswith("M") else int(text)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="10M,100M")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    cases = [(n, 1) for n in sizes] + [(n, 100) for n in sizes if n >= 100_000_000]
    limit = rmw_bandwidth(max(sizes), args.repeats)
    print(f"bench_adam: {THREADS} threads, median of {args.repeats} steps; read-modify-write limit "
          f"b[i] += s*c[i]: {limit / 1e9:.1f} GB/s")
    results = []
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
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"bench": "adam", "threads": THREADS, "rmw_limit_GBps": limit / 1e9,
                                                    "results": results}, indent=2))


if __name__ == "__main__":
    main()
