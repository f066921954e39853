"""1-bit compressed all-reduce against the fp32 all_reduce, same run, 2 gloo ranks, 1M/16M/64M
fp32 elements: bytes each rank sends (from the comms logger's own counts), time, and the error
of one call relative to the exact mean.

    python benchmarks/bench_compressed.py [--sizes 1,16,64] [--json out.json]

Goal: at least 20x fewer bytes sent per rank than the fp32 all_reduce.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import ds_comm
from ds_comm.testing import spawn


def measure(rank, world, millions):
    rows = []
    for m in millions:
        n = m * 1_000_000
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        exact = x.clone()
        ds_comm.all_reduce(exact)
        exact /= world
        padded, chunk = ds_comm.error_buffer_sizes(n, world)
        worker_error, server_error = torch.zeros(padded), torch.zeros(chunk)
        # bytes: one logged call of each
        ds_comm.configure(enabled=True)
        y = x.clone()
        ds_comm.all_reduce(y)
        fp32_bytes = sum(r.bus_bytes for r in ds_comm.comms_logger.records())
        ds_comm.comms_logger.reset()
        z = x.clone()
        ds_comm.compressed_allreduce(z, worker_error, server_error)
        compressed_bytes = sum(r.bus_bytes for r in ds_comm.comms_logger.records())
        ds_comm.comms_logger.reset()
        ds_comm.configure(enabled=False)
        error = ((z - exact).norm() / exact.norm()).item()
        times = {"fp32": [], "compressed": []}
        for _ in range(3):
            ds_comm.barrier()
            t = time.perf_counter()
            ds_comm.all_reduce(x.clone())
            times["fp32"].append(time.perf_counter() - t)
            ds_comm.barrier()
            t = time.perf_counter()
            ds_comm.compressed_allreduce(x.clone(), worker_error, server_error)
            times["compressed"].append(time.perf_counter() - t)
        rows.append({"elements": n, "fp32_bytes": fp32_bytes, "compressed_bytes": compressed_bytes,
                     "byte_ratio": fp32_bytes / compressed_bytes, "fp32_ms": statistics.median(times["fp32"]) * 1e3,
                     "compressed_ms": statistics.median(times["compressed"]) * 1e3, "error_one_call": error})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1,16,64", help="millions of fp32 elements")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    rows = spawn(measure, world_size=2, args=([int(s) for s in args.sizes.split(",")],), timeout=1800)[0]
    print("bench_compressed: 2 gloo ranks; bytes = what each rank sends (comms logger bus bytes)")
    print(f"{'elements':>10}{'fp32 MB':>10}{'1-bit MB':>10}{'fewer':>8}{'fp32 ms':>10}{'1-bit ms':>10}{'time ratio':>12}"
          f"{'rel. error':>12}")
    for r in rows:
        print(f"{r['elements'] // 1_000_000:>9}M{r['fp32_bytes'] / 2**20:>10.2f}{r['compressed_bytes'] / 2**20:>10.3f}"
              f"{r['byte_ratio']:>7.1f}x{r['fp32_ms']:>10.1f}{r['compressed_ms']:>10.1f}"
              f"{r['fp32_ms'] / r['compressed_ms']:>11.2f}x{r['error_one_call']:>12.3f}")
    worst = min(r["byte_ratio"] for r in rows)
    print(f"fewest-bytes ratio {worst:.1f}x (goal >= 20x: {'met' if worst >= 20 else 'missed'})")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"bench": "compressed", "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
