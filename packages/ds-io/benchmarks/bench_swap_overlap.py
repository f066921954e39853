"""Does the swapper's I/O hide behind compute? 1 GiB swapped out and 1 GiB swapped in, in 64 MiB
pieces (one request each, all in flight at once), with a CPU compute pass over another buffer
between issuing them and waiting for them. Measured, interleaved, ``--repeats`` times (medians):

* I/O alone: issue the 32 requests, wait for them;
* compute alone: the compute pass (calibrated to take about as long as the I/O alone);
* overlapped: issue, compute, wait.

Goal: overlapped <= 1.1 x max(I/O alone, compute alone); the baseline is what blocking I/O gives,
I/O + compute. A second row does the same the way ZeRO-Infinity steps sub-groups ("pipelined"):
swap in piece i+2 while computing on piece i (the compute reads and writes the swapped-in
bytes), then swap piece i out. O_DIRECT both ways, so the page cache plays no part.

    python benchmarks/bench_swap_overlap.py [--size 1G] [--piece 64M] [--dir /tmp] [--repeats 3]
                                            [--aio '{"thread_count": 2}'] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from ds_io import AioConfig, AsyncIOHandle, TensorSwapper
from ds_io.tune import parse_size

# One I/O thread with 4 MiB pieces moves as fast as two with 1 MiB here and leaves the compute its
# core on a 2-core machine (two threads x 1 MiB measured 1.21x instead of 1.02x once).
DEFAULT_AIO = {"block_size": 4 * 1048576, "queue_depth": 8, "thread_count": 1, "overlap_events": True}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1G", help="bytes swapped out, and again swapped in (default 1G)")
    parser.add_argument("--piece", default="64M", help="bytes per request (default 64M)")
    parser.add_argument("--dir", default="/tmp", help="where the swap files go (default /tmp)")
    parser.add_argument("--repeats", type=int, default=3, help="measurements of each case (medians; default 3)")
    parser.add_argument("--aio", default=json.dumps(DEFAULT_AIO), help="the aio section as JSON")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON")
    args = parser.parse_args(argv)
    size, piece = parse_size(args.size, "--size"), parse_size(args.piece, "--piece")
    if size % piece or piece % 4096:
        parser.error("--size must be a multiple of --piece, and --piece of 4096")
    count = size // piece
    config = AioConfig(**json.loads(args.aio))
    torch.set_num_threads(1)  # the compute takes one core; the I/O threads the rest
    free = shutil.disk_usage(args.dir).free
    if free < 3 * size:
        parser.error(f"--dir {args.dir} has {free / 2**30:.1f} GiB free; needs {3 * size / 2**30:.1f}")

    work = Path(tempfile.mkdtemp(prefix="bench_swap_overlap.", dir=args.dir))
    allocator = AsyncIOHandle()
    outgoing: list[torch.Tensor] = []
    incoming: list[torch.Tensor] = []
    try:
        def locked(seed: int) -> torch.Tensor:  # page-locked, aligned, holding floats in [0, 1)
            t = allocator.new_cpu_locked_tensor(piece, torch.empty(0, dtype=torch.uint8))
            t.view(torch.float32).uniform_(generator=torch.Generator().manual_seed(seed))
            return t
        outgoing.extend(locked(k) for k in range(count))
        incoming.extend(locked(1000 + k) for k in range(count))
        compute_buffer = torch.ones(piece // 4, dtype=torch.float32)  # "another buffer"
        with TensorSwapper(work, config) as swapper:
            in_keys = [f"in.{k}" for k in range(count)]
            out_keys = [f"out.{k}" for k in range(count)]
            expected = [t[:4096].clone() for t in incoming]
            swapper.swap_out(incoming, keys=in_keys).wait()  # what the swap-ins read

            def issue():
                requests = []
                for k in range(count):
                    requests.append(swapper.swap_out([outgoing[k]], keys=[out_keys[k]]))
                    requests.append(swapper.swap_in([in_keys[k]], out=[incoming[k]]))
                return requests

            def wait_all(requests):
                for r in requests:
                    r.wait()

            passes = 1

            def compute(buffer: torch.Tensor, n: int) -> None:
                for _ in range(n):
                    buffer.mul_(0.999).add_(0.001)

            def io_alone():
                wait_all(issue())

            def compute_alone():
                compute(compute_buffer, passes)

            def overlapped():
                requests = issue()
                compute(compute_buffer, passes)
                wait_all(requests)

            floats = [t.view(torch.float32) for t in incoming]
            per_piece = 1

            def pipelined(with_compute: bool = True):  # ZeRO-Infinity's sub-group step: prefetch i+2,
                ahead = 2                                  # compute i, write i back
                reads = {k: swapper.swap_in([in_keys[k]], out=[incoming[k]]) for k in range(min(ahead, count))}
                writes = []
                for k in range(count):
                    if k + ahead < count:
                        reads[k + ahead] = swapper.swap_in([in_keys[k + ahead]], out=[incoming[k + ahead]])
                    reads.pop(k).wait()
                    if with_compute:
                        compute(floats[k], per_piece)
                    writes.append(swapper.swap_out([incoming[k]], keys=[out_keys[k]]))
                wait_all(writes)

            def pipelined_compute_alone():
                for k in range(count):
                    compute(floats[k], per_piece)

            # calibrate: the compute pass about as long as the I/O alone
            io_alone()
            io_once = min(timed(io_alone) for _ in range(2))
            compute(compute_buffer, 2)
            one_pass = timed(lambda: compute(compute_buffer, 5)) / 5
            passes = max(1, round(io_once / one_pass))
            one_piece_pass = timed(lambda: compute(floats[0], 5)) / 5
            per_piece = max(1, round(io_once / count / one_piece_pass))
            print(f"  calibrated: I/O alone {io_once:.2f} s; compute {passes} passes over "
                  f"{piece >> 20} MiB ({one_pass * 1e3:.0f} ms each)", file=sys.stderr, flush=True)

            cases = {"io": io_alone, "compute": compute_alone, "overlapped": overlapped,
                     "pipelined io": lambda: pipelined(with_compute=False), "pipelined compute": pipelined_compute_alone,
                     "pipelined": pipelined}
            times: dict[str, list[float]] = {name: [] for name in cases}
            for repeat in range(args.repeats):
                for name, fn in cases.items():  # interleaved
                    times[name].append(timed(fn))
                print(f"  repeat {repeat + 1}/{args.repeats} done", file=sys.stderr, flush=True)
            # the data survived the round trips (the pipelined compute changes the incoming bytes;
            # check them against what the last round wrote, read back once more)
            swapper.swap_in(in_keys[:1], out=[incoming[0]]).wait()
            last = swapper.swap_in(out_keys[-1:]).wait()[0]
            intact = torch.equal(incoming[0][:4096], expected[0]) and torch.equal(last, incoming[-1])
            swapper.release(in_keys + out_keys)
    finally:
        for t in outgoing + incoming:
            allocator.free_cpu_locked_tensor(t)
        allocator.close()
        shutil.rmtree(work, ignore_errors=True)

    med = {name: statistics.median(v) for name, v in times.items()}
    moved = 2 * size
    rows = {
        "bulk": {"io_s": med["io"], "compute_s": med["compute"], "overlapped_s": med["overlapped"]},
        "pipelined": {"io_s": med["pipelined io"], "compute_s": med["pipelined compute"],
                      "overlapped_s": med["pipelined"]},
    }
    for row in rows.values():
        row["sequential_s"] = row["io_s"] + row["compute_s"]
        row["ratio_to_max"] = row["overlapped_s"] / max(row["io_s"], row["compute_s"])
        row["io_gbps"] = moved / row["io_s"] / 1e9
    print(f"\nbench_swap_overlap: {size / 2**30:.2f} GiB out + {size / 2**30:.2f} GiB in, {count} requests of "
          f"{piece >> 20} MiB each way, in {args.dir}; aio {json.dumps(config.handle_kwargs())}; "
          f"median of {args.repeats}")
    print(f"{'':<11}{'I/O alone':>12}{'compute':>12}{'overlapped':>12}{'I/O+compute':>13}"
          f"{'overlapped/max':>16}{'I/O GB/s':>10}")
    for name, row in rows.items():
        print(f"{name:<11}{row['io_s']:>11.2f}s{row['compute_s']:>11.2f}s{row['overlapped_s']:>11.2f}s"
              f"{row['sequential_s']:>12.2f}s{row['ratio_to_max']:>15.2f}x{row['io_gbps']:>10.2f}")
    goal = rows["bulk"]["ratio_to_max"] <= 1.1
    print(f"\ngoal (bulk): overlapped <= 1.1 x max(I/O, compute): {rows['bulk']['ratio_to_max']:.2f}x -> "
          f"{'met' if goal else 'NOT met'}; blocking I/O would take "
          f"{rows['bulk']['sequential_s'] / max(rows['bulk']['io_s'], rows['bulk']['compute_s']):.2f}x")
    if not intact:
        print("ERROR: the swapped-in bytes differ from those swapped out", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "size": size, "piece": piece, "requests_each_way": count, "dir": args.dir, "repeats": args.repeats,
            "aio": config.handle_kwargs(), "compute_passes": passes, "compute_passes_per_piece": per_piece,
            "times_s": times, "rows": rows, "goal_met": goal, "data_intact": intact}, indent=1))
    return 0 if intact else 1


if __name__ == "__main__":
    sys.exit(main())
