"""ds_comm against raw torch.distributed, same run, 2 gloo ranks: all_reduce, all_gather_into_tensor,
reduce_scatter_tensor, broadcast from 4 KB to 64 MB, with the comms logger off and on.

    python benchmarks/bench_collectives.py [--max-mb 64] [--json out.json]

Goal: ds_comm / raw <= 1.02 with logging off at every size >= 1 MB. Each time is the median of
interleaved repetitions (raw, ds off, ds on, raw, ...), each after a barrier.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import ds_comm
from ds_comm.testing import spawn

OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")


def _calls(op: str, nbytes: int, world: int):
    n = nbytes // 4
    x = torch.ones(n)
    if op == "all_reduce":
        return (lambda: dist.all_reduce(x)), (lambda: ds_comm.all_reduce(x))
    if op == "broadcast":
        return (lambda: dist.broadcast(x, 0)), (lambda: ds_comm.broadcast(x, 0))
    if op == "all_gather_into_tensor":
        part, out = torch.ones(n // world), torch.empty(n // world * world)
        return (lambda: dist.all_gather_into_tensor(out, part)), (lambda: ds_comm.all_gather_into_tensor(out, part))
    big, out = torch.ones(n // world * world), torch.empty(n // world)
    return (lambda: dist.reduce_scatter_tensor(out, big)), (lambda: ds_comm.reduce_scatter_tensor(out, big))


def _time(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(rank, world, max_mb):
    sizes = [4096 * 4**k for k in range(12) if 4096 * 4**k <= max_mb * 2**20]
    rows = []
    for op in OPS:
        for nbytes in sizes:
            raw, ours = _calls(op, nbytes, world)
            reps = max(15, min(200, int(2**28 // nbytes)))
            raw(), ours()  # warm up
            times = {"raw": [], "off": [], "on": []}
            for _ in range(reps):
                times["raw"].append(_time(raw))
                times["off"].append(_time(ours))
                ds_comm.configure(enabled=True)
                times["on"].append(_time(ours))
                ds_comm.configure(enabled=False)
            ds_comm.comms_logger.reset()
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append({"op": op, "bytes": nbytes, "raw_ms": med["raw"] * 1e3, "ds_off_ms": med["off"] * 1e3,
                         "ds_on_ms": med["on"] * 1e3, "ratio_off": med["off"] / med["raw"],
                         "ratio_on": med["on"] / med["raw"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-mb", type=int, default=64)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    rows = spawn(measure, world_size=2, args=(args.max_mb,), timeout=1800)[0]
    print("bench_collectives: 2 gloo ranks, medians of interleaved repetitions")
    print(f"{'op':<24}{'size':>9}{'raw ms':>10}{'ds off ms':>11}{'ds on ms':>10}{'off/raw':>9}{'on/raw':>8}")
    for r in rows:
        size = f"{r['bytes'] // 1024} KB" if r["bytes"] < 2**20 else f"{r['bytes'] // 2**20} MB"
        print(f"{r['op']:<24}{size:>9}{r['raw_ms']:>10.3f}{r['ds_off_ms']:>11.3f}{r['ds_on_ms']:>10.3f}"
              f"{r['ratio_off']:>9.3f}{r['ratio_on']:>8.3f}")
    big = [r for r in rows if r["bytes"] >= 2**20]
    worst = max(r["ratio_off"] for r in big)
    print(f"worst ds_comm/raw with logging off at >= 1 MB: {worst:.3f} (goal <= 1.02: {'met' if worst <= 1.02 else 'missed'})")
    print(f"median logger overhead at >= 1 MB: {statistics.median(r['ratio_on'] for r in big):.3f}x")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"bench": "collectives", "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
