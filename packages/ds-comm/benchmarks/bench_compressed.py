"""1-bit compressed all-reduce against the fp32 all_reduce, same run, 2 gloo ranks, 1M/16M/64M
fp32 elements: bytes each rank sends (from the comms logger's own counts), the time of the fp32
all_reduce, of the 1-bit all-reduce on torch ops and on ds-ops' kernels, and the error of one call
relative to the exact mean. Then the kernels alone (compress, average, decompress, both ranks at
once as in the all-reduce): the bytes they read and write per second, against this machine's
memory bandwidth measured in the same run the same way (both ranks streaming an in-place
``b += 0.5 * c`` over float32 buffers of the same size: 12 bytes per element, no write-allocate), and
the floor that sets: the kernels' bytes at that bandwidth, against the fp32 all_reduce.

    python benchmarks/bench_compressed.py [--sizes 1,16,64] [--threads 1] [--reps 7] [--phases] [--json out.json]

Each rank runs ``--threads`` threads (default 1: 2 ranks x 1 thread fill the 2 cores here). The
three all-reduces run interleaved, ``--reps`` times each (the input copied in before the clock
starts), and the table shows medians; the torch path runs 3 times at 64M (seconds per call).
``--phases`` then times the parts of ``--reps`` more native calls on each rank: the kernels, issuing
the two exchanges, waiting for them, and the rest (Python, the staging buffer).

Goals: at least 20x fewer bytes sent per rank than the fp32 all_reduce; the native 1-bit
all-reduce of 16M and 64M elements in at most 0.5x the fp32 all_reduce's time; the kernels at 50 %
or more of the memory bandwidth.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import ds_comm
from ds_comm import compressed
from ds_comm.testing import spawn

SCALE_BYTES = 4


def _timed(fn) -> float:
    ds_comm.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def kernel_bytes(n: int, world: int) -> dict[str, int]:
    """Bytes each kernel reads + writes on one rank (onebit.h's one pass each)."""
    worker, server = ds_comm.error_buffer_sizes(n, world)
    chunk = server - 1
    frames = world * (chunk // 8 + SCALE_BYTES)
    return {
        # reads x and the error state (values and scales), writes the state and the frames
        "compress": 4 * n + 2 * 4 * worker + frames,
        # reads the world frames and the server's state, writes the state and one frame
        "average": frames + 2 * 4 * server + frames // world,
        # reads the gathered frames, writes the result
        "decompress": frames + 4 * n,
    }


def measure(rank, world, millions, threads, reps, phases):
    from ds_ops import onebit

    torch.set_num_threads(threads)
    onebit.load()  # built (or loaded from the cache) before any clock runs
    rows = [measure_size(onebit, rank, world, m, reps) for m in millions]
    if phases:
        for row, m in zip(rows, millions, strict=True):
            row["phases"] = time_phases(onebit, rank, world, m, reps)  # ms
    return rows


class _Timed:
    """Stands in for ds-ops' onebit module or ds_comm's exchange inside compressed_allreduce, adding
    each call's seconds (and those of waiting on the works an exchange returns) to ``spent``."""

    def __init__(self, spent: dict[str, float], target, name: str | None = None):
        self._spent, self._target, self._name = spent, target, name

    def _add(self, name: str, start: float) -> None:
        self._spent[name] = self._spent.get(name, 0.0) + time.perf_counter() - start

    def __getattr__(self, name):  # the kernels: compress, average, decompress
        fn = getattr(self._target, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._add(name, start)
        return timed

    def __call__(self, *args, **kwargs):  # the exchange: issue, then each wait
        start = time.perf_counter()
        works = self._target(*args, **kwargs)
        self._add("issue", start)
        return [_TimedWork(self, work) for work in works]


class _TimedWork:
    def __init__(self, timer: _Timed, work):
        self._timer, self._work = timer, work

    def wait(self):
        start = time.perf_counter()
        try:
            return self._work.wait()
        finally:
            self._timer._add("wait", start)


def time_phases(onebit, rank, world, millions, reps) -> dict[str, float]:
    """Median ms per native call of each part: the kernels, issuing and waiting for the exchanges, the rest."""
    n = millions * 1_000_000
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    y = torch.empty_like(x)
    errors = tuple(torch.zeros(size) for size in ds_comm.error_buffer_sizes(n, world))
    kernels, exchange = compressed._native_kernels(), compressed._exchange
    per_call: list[dict[str, float]] = []
    try:
        for rep in range(reps + 1):
            spent: dict[str, float] = {}
            compressed._native = _Timed(spent, kernels)
            compressed._exchange = _Timed(spent, exchange)
            y.copy_(x)
            total = _timed(lambda: compressed.compressed_allreduce(y, *errors, native=True))
            spent["rest"] = total - sum(spent.values())
            spent["call"] = total
            if rep:  # the first call warms the staging buffer
                per_call.append(spent)
    finally:
        compressed._native, compressed._exchange = kernels, exchange
    return {name: statistics.median(c.get(name, 0.0) for c in per_call) * 1e3
            for name in ("compress", "issue", "wait", "average", "decompress", "rest", "call")}


def measure_size(onebit, rank, world, millions, reps):
    n = millions * 1_000_000
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    exact = x.clone()
    ds_comm.all_reduce(exact)
    exact /= world
    sizes = ds_comm.error_buffer_sizes(n, world)
    chunk = sizes[1] - 1
    errors = {name: tuple(torch.zeros(size) for size in sizes) for name in ("torch", "native")}
    y = torch.empty_like(x)

    # bytes and error: one logged call of each
    ds_comm.configure(enabled=True)
    y.copy_(x)
    ds_comm.all_reduce(y)
    fp32_bytes = sum(r.bus_bytes for r in ds_comm.comms_logger.records())
    ds_comm.comms_logger.reset()
    y.copy_(x)
    ds_comm.compressed_allreduce(y, *errors["native"], native=True)
    compressed_bytes = sum(r.bus_bytes for r in ds_comm.comms_logger.records())
    ds_comm.comms_logger.reset()
    ds_comm.configure(enabled=False)
    error = ((y - exact).norm() / exact.norm()).item()

    ops = {
        "fp32": lambda: ds_comm.all_reduce(y),
        "torch": lambda: ds_comm.compressed_allreduce(y, *errors["torch"], native=False),
        "native": lambda: ds_comm.compressed_allreduce(y, *errors["native"], native=True),
    }
    times = {name: [] for name in ops}
    for rep in range(reps):
        for name, op in ops.items():
            if name == "torch" and millions >= 64 and rep >= 3:
                continue
            y.copy_(x)
            times[name].append(_timed(op))

    # the kernels alone, on this rank's real data, interleaved with the bandwidth probe
    worker_error, server_error = errors["native"]
    frames = torch.empty(world, onebit.frame_bytes(chunk), dtype=torch.uint8)
    out = torch.empty(onebit.frame_bytes(chunk), dtype=torch.uint8)
    onebit.compress(x, worker_error, frames)  # frames of real data for the other two
    b, c = torch.ones(n), torch.full((n,), 2.0)
    kernels = {
        "compress": lambda: onebit.compress(x, worker_error, frames),
        "average": lambda: onebit.average(frames, server_error, out),
        "decompress": lambda: onebit.decompress(frames, y),
        "rmw": lambda: b.add_(c, alpha=0.5),
    }
    kernel_times = {name: [] for name in kernels}
    for _ in range(reps):
        for name, fn in kernels.items():
            kernel_times[name].append(_timed(fn))
    medians = {name: statistics.median(t) for name, t in {**times, **kernel_times}.items()}
    return {"elements": n, "fp32_bytes": fp32_bytes, "compressed_bytes": compressed_bytes,
            "byte_ratio": fp32_bytes / compressed_bytes, "error_one_call": error,
            **{f"{name}_ms": value * 1e3 for name, value in medians.items()},
            "kernel_bytes": kernel_bytes(n, world), "rmw_bytes": 12 * n}


def combine(per_rank: list[list[dict]]) -> list[dict]:
    """One row per size: the slowest rank's median times (the collectives wait for it)."""
    rows = []
    for by_rank in zip(*per_rank, strict=True):
        row = dict(by_rank[0])
        for key in row:
            if key.endswith("_ms"):
                row[key] = max(r[key] for r in by_rank)
        kernels = ("compress", "average", "decompress")
        total_bytes = sum(row["kernel_bytes"][k] for k in kernels)
        row["kernels_ms"] = sum(row[f"{k}_ms"] for k in kernels)
        row["kernels_GBps"] = total_bytes / (row["kernels_ms"] / 1e3) / 1e9
        row["rmw_GBps"] = row["rmw_bytes"] / (row["rmw_ms"] / 1e3) / 1e9
        row["fraction_of_bandwidth"] = row["kernels_GBps"] / row["rmw_GBps"]
        # the kernels' bytes at the probe's bandwidth: what a call would take with nothing but them, at
        # the speed of a plain read-modify-write (their floor in this run)
        row["floor_ms"] = total_bytes / (row["rmw_GBps"] * 1e9) * 1e3
        row["floor_over_fp32"] = row["floor_ms"] / row["fp32_ms"]
        row["native_over_fp32"] = row["native_ms"] / row["fp32_ms"]
        row["torch_over_fp32"] = row["torch_ms"] / row["fp32_ms"]
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1,16,64", help="millions of fp32 elements")
    parser.add_argument("--threads", type=int, default=1, help="threads per rank")
    parser.add_argument("--reps", type=int, default=7, help="interleaved runs of each all-reduce and kernel")
    parser.add_argument("--phases", action="store_true", help="then time the parts of native calls on each rank")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    per_rank = spawn(measure, world_size=2, args=(sizes, args.threads, args.reps, args.phases), timeout=3600)
    rows = combine(per_rank)
    print(f"bench_compressed: 2 gloo ranks x {args.threads} thread(s); medians of {args.reps} interleaved runs, "
          "the slower rank's; bytes = what each rank sends (comms logger bus bytes)")
    print(f"{'elements':>9}{'fp32 MB':>9}{'1-bit MB':>10}{'fewer':>7}{'fp32 ms':>9}{'torch ms':>10}{'native ms':>11}"
          f"{'native/fp32':>13}{'torch/fp32':>12}{'rel. error':>12}")
    for r in rows:
        print(f"{r['elements'] // 1_000_000:>8}M{r['fp32_bytes'] / 2**20:>9.2f}{r['compressed_bytes'] / 2**20:>10.3f}"
              f"{r['byte_ratio']:>6.1f}x{r['fp32_ms']:>9.1f}{r['torch_ms']:>10.1f}{r['native_ms']:>11.1f}"
              f"{r['native_over_fp32']:>12.2f}x{r['torch_over_fp32']:>11.2f}x{r['error_one_call']:>12.3f}")
    print("kernels, per rank with both ranks running (GB/s = bytes read + written / time):")
    print(f"{'elements':>9}{'compress ms':>13}{'average ms':>12}{'decomp. ms':>12}{'kernels GB/s':>14}"
          f"{'memory GB/s':>13}{'fraction':>10}{'floor ms':>10}{'floor/fp32':>12}")
    for r in rows:
        print(f"{r['elements'] // 1_000_000:>8}M{r['compress_ms']:>13.2f}{r['average_ms']:>12.2f}"
              f"{r['decompress_ms']:>12.2f}{r['kernels_GBps']:>14.1f}{r['rmw_GBps']:>13.1f}"
              f"{r['fraction_of_bandwidth']:>9.0%}{r['floor_ms']:>10.1f}{r['floor_over_fp32']:>11.2f}x")
    print("floor = the kernels' bytes at the memory GB/s: a call with nothing but its kernels, at that speed")
    if args.phases:
        names = ("compress", "issue", "wait", "average", "decompress", "rest", "call")
        print(f"one native call in parts, ms per rank (medians of {args.reps}; issue/wait: the two exchanges):")
        print(f"{'elements':>9}{'rank':>5}" + "".join(f"{name:>12}" for name in names))
        for size_rows in zip(*per_rank, strict=True):
            for rank, row in enumerate(size_rows):
                print(f"{row['elements'] // 1_000_000:>8}M{rank:>5}" + "".join(f"{row['phases'][k]:>12.2f}" for k in names))
    worst = min(r["byte_ratio"] for r in rows)
    print(f"fewest-bytes ratio {worst:.1f}x (goal >= 20x: {'met' if worst >= 20 else 'missed'})")
    big = [r for r in rows if r["elements"] >= 16_000_000]
    if big:
        slowest = max(r["native_over_fp32"] for r in big)
        print(f"native 1-bit / fp32 time at 16M+: at most {slowest:.2f}x (goal <= 0.5x: "
              f"{'met' if slowest <= 0.5 else 'missed'})")
    lowest = min(r["fraction_of_bandwidth"] for r in rows)
    print(f"kernels at >= {lowest:.0%} of the memory bandwidth (goal >= 50%: {'met' if lowest >= 0.5 else 'missed'})")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"bench": "compressed", "threads": args.threads, "reps": args.reps,
                                                    "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
