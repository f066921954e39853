"""ds_comm's bucketed collectives against the naive torch.distributed path, same run, 2 gloo ranks
(1 intra-op thread each), for a bucket of 64 parameters of mixed sizes, from 1 MB to 64 MB (fp32).

    python benchmarks/bench_buckets.py [--max-mb 64] [--json out.json]

What ZeRO does each step, the naive way and ours:

* reduce-scatter of gradients: naive = flatten the gradients (torch.cat: allocate + copy), then
  torch's reduce_scatter_tensor into a new shard; ours = gradients are views of a persistent flat
  bucket, reduce_scatter_bucket into a persistent shard.
* all-gather of parameters: naive = all_gather_into_tensor into a new buffer, then copy out into
  the parameters; ours = parameters are views of the bucket, all_gather_bucket in place.
* coalesced all-reduce: naive = _flatten_dense_tensors + all_reduce + copy back (ds_comm before);
  ours = all_reduce_coalesced on separate tensors (staged) and on views of one buffer (in place).

The "collective only" rows call torch's and ours on the same persistent buffers: the gloo paths
alone. Each time is the median of interleaved repetitions (naive, ours, naive, ...), each after a
barrier; ratio = ours / naive (below 1: ours is faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

import ds_comm
from ds_comm.testing import spawn


def _sizes(total: int, count: int = 64) -> list[int]:
    """``count`` parameter sizes of mixed magnitude summing to ``total`` (a multiple of 2 here)."""
    weights = [1 + (i * 37) % 11 for i in range(count)]
    sizes = [total * w // sum(weights) // 2 * 2 for w in weights]
    sizes[-1] += total - sum(sizes)
    return sizes


def _time(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _cases(numel: int, world: int, rank: int) -> dict:
    sizes = _sizes(numel)
    grads = [torch.ones(s) for s in sizes]  # separate tensors: what a naive loop holds
    bucket = torch.ones(numel)
    views = list(bucket.split(sizes))  # the same gradients living in one flat bucket
    shard = torch.empty(numel // world)
    params = [torch.empty(s) for s in sizes]

    def naive_reduce_scatter():
        out = torch.empty(numel // world)
        dist.reduce_scatter_tensor(out, torch.cat(grads))

    def naive_all_gather():
        out = torch.empty(numel)
        dist.all_gather_into_tensor(out, shard)
        torch._foreach_copy_(params, list(out.split(sizes)))

    def naive_coalesced():
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        for dst, src in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            dst.copy_(src)

    mine = bucket.view(world, -1)[rank]
    return {
        "reduce-scatter, ZeRO step": (naive_reduce_scatter, lambda: ds_comm.reduce_scatter_bucket(bucket, shard)),
        "reduce-scatter, collective only": (lambda: dist.reduce_scatter_tensor(shard, bucket),
                                            lambda: ds_comm.reduce_scatter_bucket(bucket, shard)),
        "all-gather, ZeRO step": (naive_all_gather, lambda: ds_comm.all_gather_bucket(bucket)),
        "all-gather, collective only": (lambda: dist.all_gather_into_tensor(bucket, mine),
                                        lambda: ds_comm.all_gather_bucket(bucket)),
        "coalesced all-reduce, staged": (naive_coalesced, lambda: ds_comm.all_reduce_coalesced(grads)),
        "coalesced all-reduce, in a bucket": (naive_coalesced, lambda: ds_comm.all_reduce_coalesced(views)),
    }


def measure(rank, world, max_mb):
    torch.set_num_threads(1)
    rows = []
    for mb in (1, 4, 16, 64):
        if mb > max_mb:
            break
        nbytes = mb * 2**20
        reps = max(10, min(60, 2**28 // nbytes))
        for name, (naive, ours) in _cases(nbytes // 4, world, rank).items():
            naive(), ours()  # warm up (ours allocates its staging buffer once)
            times = {"naive": [], "ours": []}
            for _ in range(reps):
                times["naive"].append(_time(naive))
                times["ours"].append(_time(ours))
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append({"case": name, "bytes": nbytes, "naive_ms": med["naive"] * 1e3, "ours_ms": med["ours"] * 1e3,
                         "ratio": med["ours"] / med["naive"], "reps": reps})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-mb", type=int, default=64)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    rows = spawn(measure, world_size=2, args=(args.max_mb,), timeout=1800)[0]
    print("bench_buckets: 2 gloo ranks x 1 thread, fp32, medians of interleaved repetitions (rank 0's times)")
    print(f"{'case':<36}{'size':>7}{'naive ms':>10}{'ours ms':>9}{'ours/naive':>12}")
    for r in rows:
        print(f"{r['case']:<36}{r['bytes'] // 2**20:>4} MB{r['naive_ms']:>10.3f}{r['ours_ms']:>9.3f}{r['ratio']:>12.3f}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"bench": "buckets", "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
