"""The flat layout: every element of every parameter has exactly one place, buckets split evenly,
and the ranks' pieces cover each parameter exactly once (checked element by element)."""

from __future__ import annotations

import pytest
import torch

from ds_zero._layout import FlatLayout

SHAPES = [(7, 3), (5,), (64, 9), (1,), (33,), (2, 2, 2)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket_size", [1, 40, 100, 10_000])
@pytest.mark.parametrize("align", [1, 4])
def test_every_element_has_one_place_and_one_owner(world_size, bucket_size, align):
    layout = FlatLayout(SHAPES, world_size=world_size, bucket_size=bucket_size, align=align)
    # the flat buffer: each parameter's range is disjoint from the others and inside its bucket
    owner = torch.full((layout.numel,), -1)
    for slot in layout.slots:
        assert (owner[slot.offset:slot.offset + slot.numel] == -1).all()
        owner[slot.offset:slot.offset + slot.numel] = slot.index
        bucket = layout.buckets[slot.bucket]
        assert bucket.offset <= slot.offset and slot.offset + slot.numel <= bucket.offset + bucket.numel
    assert layout.param_numel == sum(torch.Size(s).numel() for s in SHAPES)
    # buckets: contiguous, evenly split, aligned, at most bucket_size unless one parameter is larger
    at = 0
    for bucket in layout.buckets:
        assert bucket.offset == at and bucket.padded == bucket.shard * world_size and bucket.shard % align == 0
        assert bucket.numel <= bucket.padded < bucket.numel + world_size * align or bucket.numel == 0
        assert bucket.numel <= bucket_size or len(bucket.slots) == 1
        at += bucket.padded
    assert at == layout.numel and layout.shard_numel * world_size == layout.numel
    # reverse order: the last parameter (first gradient in backward) comes first
    assert [layout.slots[i].offset for i in range(len(SHAPES))] == sorted(
        (s.offset for s in layout.slots), reverse=True)
    # the pieces of all ranks rebuild every parameter exactly once, at the partition offsets
    flat = torch.arange(layout.numel)
    seen = [torch.zeros(torch.Size(s).numel(), dtype=torch.int64) for s in SHAPES]
    for rank in range(world_size):
        partition = torch.cat([flat[layout.shard_range(b, rank)[0]:][:b.shard] for b in layout.buckets])
        assert partition.numel() == layout.shard_numel
        for piece in layout.pieces(rank):
            slot = layout.slots[piece.index]
            got = partition[piece.partition_offset:piece.partition_offset + piece.numel]
            want = torch.arange(slot.offset + piece.param_offset, slot.offset + piece.param_offset + piece.numel)
            assert torch.equal(got, want)
            seen[piece.index][piece.param_offset:piece.param_offset + piece.numel] += 1
    assert all((s == 1).all() for s in seen)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="world_size must be a positive integer, got 0"):
        FlatLayout(SHAPES, world_size=0, bucket_size=10)
    with pytest.raises(ValueError, match="bucket_size must be a positive integer, got True"):
        FlatLayout(SHAPES, world_size=2, bucket_size=True)
    with pytest.raises(ValueError, match="no parameters"):
        FlatLayout([], world_size=2, bucket_size=10)
    with pytest.raises(ValueError, match=r"rank must be in 0\.\.1, got 2"):
        FlatLayout(SHAPES, world_size=2, bucket_size=10).pieces(2)
