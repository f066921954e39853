"""Bucketed collectives over caller-owned flat buffers, against torch.distributed's own results,
and without per-call allocation, on real gloo ranks."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import ds_comm
from ds_comm.collectives import _staging as staging
from ds_comm.testing import spawn

OPS = {"sum": ds_comm.ReduceOp.SUM, "max": ds_comm.ReduceOp.MAX, "min": ds_comm.ReduceOp.MIN,
       "product": ds_comm.ReduceOp.PRODUCT, "avg": ds_comm.ReduceOp.AVG}


def _data(rank: int, n: int, dtype=torch.float32) -> torch.Tensor:
    """Small integers (exact in every dtype used here, products included), different per rank."""
    return ((torch.arange(n) * (rank + 3)) % 7 + 1 + rank).to(dtype)


def reduce_scatter_matches_torch(rank, world):
    mismatches = []
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.uint8):
        for name, op in OPS.items():
            if name == "avg" and not dtype.is_floating_point:
                continue
            flat, n = _data(rank, 12 * world, dtype), 12
            before = flat.clone()
            shard = torch.empty(n, dtype=dtype)
            ds_comm.reduce_scatter_bucket(flat, shard, op=op)
            # torch.distributed's own reduce-scatter (gloo lacks AVG: SUM / world then)
            expected = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(expected, before.clone(), op=ds_comm.ReduceOp.SUM if name == "avg" else op)
            if name == "avg":
                expected /= world
            if not torch.equal(shard, expected) or not torch.equal(flat, before):
                mismatches.append((str(dtype), name, shard.tolist(), expected.tolist()))
            # the same through reduce_scatter_tensor, async
            out = torch.empty(n, dtype=dtype)
            ds_comm.reduce_scatter_tensor(out, flat, op=op, async_op=True).wait()
            if not torch.equal(out, expected):
                mismatches.append(("reduce_scatter_tensor", str(dtype), name))
    # in place: the shard is this rank's own chunk of the bucket; a caller-owned staging buffer
    flat = _data(rank, 8 * world)
    expected = torch.empty(8)
    dist.reduce_scatter_tensor(expected, flat.clone())
    mine = flat.view(world, -1)[rank]
    ds_comm.reduce_scatter_bucket(flat, mine, staging=torch.empty(8 * world + 3), async_op=True).wait()
    if not torch.equal(mine, expected):
        mismatches.append(("in place", mine.tolist(), expected.tolist()))
    return mismatches


def test_reduce_scatter_bucket_matches_torch_distributed_for_every_op_and_dtype():
    assert spawn(reduce_scatter_matches_torch, world_size=2) == [[], []]


def all_gather_matches_torch(rank, world):
    results = []
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        n = 10
        shard = _data(rank, n, dtype) if dtype != torch.bool else _data(rank, n) > 4
        expected = torch.empty(n * world, dtype=dtype)
        dist.all_gather_into_tensor(expected, shard.clone())
        flat = torch.zeros(n * world, dtype=dtype)
        flat.view(world, -1)[rank].copy_(shard)
        ptr = flat.data_ptr()
        ds_comm.all_gather_bucket(flat)  # in place: the shard already sits in the bucket
        in_place = torch.equal(flat, expected) and flat.data_ptr() == ptr
        other = torch.zeros(n * world, dtype=dtype)
        ds_comm.all_gather_bucket(other, input_shard=shard, async_op=True).wait()
        out = torch.empty(n * world, dtype=dtype)
        ds_comm.all_gather_into_tensor(out, shard)
        results.append((str(dtype), in_place, torch.equal(other, expected), torch.equal(out, expected)))
    return results


def test_all_gather_bucket_matches_torch_distributed_in_place_and_from_a_shard():
    for results in spawn(all_gather_matches_torch, world_size=2):
        assert all(ok for _, *oks in results for ok in oks), results


def _allocations(fn) -> list[int]:
    """Bytes allocated through torch's CPU allocator while ``fn`` runs, per op that allocated (and
    outside any op: the profiler's "[memory]" events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return [e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0]


def no_allocation_per_call(rank, world):
    n = 1 << 18  # a 1 MiB fp32 bucket
    flat, shard = torch.ones(n), torch.empty(n // world)
    grads = [torch.ones(1000), torch.ones(3, 500), torch.ones(n // 4)]
    bucket = torch.ones(n)
    views = [bucket[:1000], bucket[1000:2500].view(3, 500), bucket[2500:]]  # gradients living in one bucket
    calls = {
        "reduce_scatter_bucket": lambda: ds_comm.reduce_scatter_bucket(flat, shard),
        "reduce_scatter_bucket async": lambda: ds_comm.reduce_scatter_bucket(flat, shard, async_op=True).wait(),
        "all_gather_bucket": lambda: ds_comm.all_gather_bucket(flat),
        "all_gather_into_tensor": lambda: ds_comm.all_gather_into_tensor(flat, shard),
        "reduce_scatter_tensor": lambda: ds_comm.reduce_scatter_tensor(shard, flat),
        "all_reduce_coalesced staged": lambda: ds_comm.all_reduce_coalesced(grads),
        "all_reduce_coalesced in a bucket": lambda: ds_comm.all_reduce_coalesced(views[::-1]),
        # the control: torch's own gloo reduce-scatter copies the whole input, so the check can fail
        "torch reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(shard, flat),
    }
    largest, staged = {}, {}
    take = staging.take
    for name, call in calls.items():
        call()  # warm: a staging buffer may be allocated once
        largest[name] = max(_allocations(call), default=0)  # what the calling thread allocates
        # the local reduction and copy-back may run in a completion callback, which the profiler does
        # not see: their only buffers are staging buffers, and those must be the same ones each call
        taken = staged[name] = set()

        def counting_take(*args, taken=taken):
            buffer = take(*args)
            taken.add(buffer.data_ptr())
            return buffer

        staging.take = counting_take
        for _ in range(3):
            call()
        staging.take = take
    ptrs = (flat.data_ptr(), shard.data_ptr(), bucket.data_ptr())
    for t in [flat, shard, bucket, *grads]:
        t.fill_(1.0)
    ds_comm.all_reduce_coalesced(views)
    ds_comm.all_reduce_coalesced(grads)
    sums_ok = bool((bucket == world).all()) and all(bool((g == world).all()) for g in grads)
    return largest, staged, ptrs == (flat.data_ptr(), shard.data_ptr(), bucket.data_ptr()), sums_ok


def test_bucketed_collectives_allocate_nothing_per_call():
    for largest, staged, same_buffers, sums_ok in spawn(no_allocation_per_call, world_size=2):
        assert largest.pop("torch reduce_scatter_tensor") >= 1 << 20  # the detector sees a whole-bucket copy
        assert largest == dict.fromkeys(largest, 0), largest
        assert all(len(ptrs) <= 1 for ptrs in staged.values()), staged  # one staging buffer, reused
        assert staged["reduce_scatter_bucket"] and staged["all_reduce_coalesced staged"]  # (the wrapper saw them)
        assert not staged["all_gather_bucket"] and not staged["all_reduce_coalesced in a bucket"]  # no staging at all
        assert same_buffers and sums_ok


def readme_bucket_example(rank, world):
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## Bucketed collectives"):]
    code = section[section.index("```python") + len("```python"):section.index("```", section.index("```python") + 9)]
    namespace = {"torch": torch, "ds_comm": ds_comm}
    exec(code, namespace)
    return namespace["shard"].tolist() == [world] * 1024 and namespace["params"].tolist() == [world] * (world * 1024)


def test_the_readme_bucket_example_runs():
    assert spawn(readme_bucket_example, world_size=2) == [True, True]
