"""Where every parameter lives in ZeRO's flat buffers, and which rank owns which part.

Parameters are laid out in reverse order (the order backward produces their gradients), grouped into
buckets of at most ``bucket_size`` elements (a larger parameter is a bucket of its own), or into the
buckets the caller gives (``groups``: stage 3's fetch units, one module's parameters each). Each bucket is
padded so that it splits into ``world_size`` equal shards of a multiple of ``align`` elements; rank
``r`` owns shard ``r`` of every bucket. So a bucket's gradients reduce-scatter and its parameters
all-gather as one contiguous, evenly split range of the flat buffer, and a rank's partition (the
concatenation of its shards) is one contiguous buffer of ``shard_numel`` elements.

A parameter may be held by some of the ranks only (``holders``: the ranks of its replica group, e.g. a
Mixture-of-Experts expert held by its expert-data-parallel group): buckets never mix parameters of
different holders, and such a bucket splits into one shard per holder, the i-th holder owning shard i
(one holder: the whole bucket). Every parameter of a layout is held by the rank that lays it out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Slot:
    """One parameter: its index in the caller's list, shape, and range of the flat buffer."""

    index: int
    shape: torch.Size
    offset: int
    numel: int
    bucket: int


@dataclass(frozen=True)
class Bucket:
    """A contiguous range of the flat buffer, ``world_size`` shards of ``shard`` elements."""

    index: int
    offset: int
    numel: int  # elements of parameters in it (the rest is padding at its end)
    padded: int  # numel rounded up to world_size shards of a multiple of align
    shard: int  # padded // world_size
    slots: tuple[int, ...]  # the parameters in it (indices of the caller's list), in flat order
    ranks: tuple[int, ...] = ()  # the ranks holding it, shard i is ranks[i]'s (every rank: ``range(world_size)``)


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that falls in one rank's partition."""

    index: int  # the parameter's index in the caller's list
    bucket: int  # the bucket whose shard holds the piece
    param_offset: int  # first element of the parameter (flattened) in this piece
    numel: int
    partition_offset: int  # where the piece starts in the rank's partition


def short_groups(groups) -> str:
    text = repr([list(g) for g in groups])
    return text if len(text) <= 80 else text[:77] + "..."


class FlatLayout:
    """The flat layout of ``shapes`` for ``world_size`` ranks (see the module docstring)."""

    def __init__(self, shapes: Sequence[torch.Size | Sequence[int]], *, world_size: int, bucket_size: int,
                 align: int = 1, groups: Sequence[Sequence[int]] | None = None,
                 holders: Sequence[tuple[int, ...] | None] | None = None):
        for name, value in (("world_size", world_size), ("bucket_size", bucket_size), ("align", align)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"FlatLayout: {name} must be a positive integer, got {value!r}")
        if not shapes:
            raise ValueError("FlatLayout: no parameters to lay out")
        self.world_size, self.bucket_size, self.align = world_size, bucket_size, align
        shapes = [torch.Size(s) for s in shapes]
        everyone = tuple(range(world_size))
        holders = [everyone if h is None else tuple(h) for h in (holders or [None] * len(shapes))]
        if len(holders) != len(shapes) or any(not h or not set(h) <= set(everyone) for h in holders):
            raise ValueError(f"FlatLayout: holders must give each of the {len(shapes)} parameters a non-empty tuple of "
                             f"ranks in 0..{world_size - 1} (or None: every rank), got {short_groups(holders)}")
        if groups is None:
            groups = self._by_size(shapes, bucket_size, holders)
        else:
            groups = self._given(groups, len(shapes))
            if any(len({holders[i] for i in g}) > 1 for g in groups):
                raise ValueError("FlatLayout: a bucket of groups mixes parameters of different holders")
        self.slots: list[Slot] = [None] * len(shapes)  # type: ignore[list-item]
        self.buckets: list[Bucket] = []
        offset = 0
        for b, group in enumerate(groups):
            ranks = holders[group[0]]
            unit = len(ranks) * align
            start = offset
            for index in group:
                self.slots[index] = Slot(index, shapes[index], offset, shapes[index].numel(), b)
                offset += shapes[index].numel()
            numel = offset - start
            padded = max(unit, -(-numel // unit) * unit)
            self.buckets.append(Bucket(b, start, numel, padded, padded // len(ranks), tuple(group), ranks))
            offset = start + padded
        self.numel = offset  # the flat buffer, padding included
        self.param_numel = sum(s.numel for s in self.slots)
        self.shard_numel = sum(b.shard for b in self.buckets)  # one rank's partition

    @staticmethod
    def _by_size(shapes: list[torch.Size], bucket_size: int, holders: list[tuple[int, ...]]) -> list[list[int]]:
        """Buckets in backward order; parameters of different holders fill buckets of their own (one
        open bucket per holders, in the order they were opened)."""
        groups: list[list[int]] = []
        open_: dict[tuple[int, ...], tuple[int, int]] = {}  # holders -> (its open bucket, elements in it)
        for index in range(len(shapes) - 1, -1, -1):
            numel, key = shapes[index].numel(), holders[index]
            if key in open_ and open_[key][1] + numel <= bucket_size:
                b, size = open_[key]
                groups[b].append(index)
                open_[key] = (b, size + numel)
            else:
                groups.append([index])
                open_[key] = (len(groups) - 1, numel)
        return groups

    @staticmethod
    def _given(groups: Sequence[Sequence[int]], count: int) -> list[list[int]]:
        """Explicit buckets (stage 3's units): each index once, none empty."""
        flat = [i for g in groups for i in g]
        if sorted(flat) != list(range(count)) or any(not g for g in groups):
            raise ValueError(f"FlatLayout: groups must hold each of the {count} parameter indices once, in "
                             f"non-empty groups; got {short_groups(groups)}")
        return [list(g) for g in groups]

    def shard_range(self, bucket: Bucket, rank: int) -> tuple[int, int]:
        """``(start, length)`` of ``rank``'s shard of ``bucket`` in the flat buffer (``rank`` must hold it)."""
        if rank not in bucket.ranks:
            raise ValueError(f"FlatLayout.shard_range: rank {rank} does not hold bucket {bucket.index} (its ranks: "
                             f"{short_groups([bucket.ranks])})")
        return bucket.offset + bucket.ranks.index(rank) * bucket.shard, bucket.shard

    def partition_offsets(self) -> list[int]:
        """Where each bucket's shard starts in a rank's partition."""
        offsets, at = [], 0
        for bucket in self.buckets:
            offsets.append(at)
            at += bucket.shard
        return offsets

    def pieces(self, rank: int) -> list[Piece]:
        """The parts of parameters in ``rank``'s partition, in partition order (padding omitted; buckets
        ``rank`` does not hold contribute none)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"FlatLayout.pieces: rank must be in 0..{self.world_size - 1}, got {rank}")
        out = []
        for bucket, at in zip(self.buckets, self.partition_offsets(), strict=True):
            if rank not in bucket.ranks:
                continue
            start, length = self.shard_range(bucket, rank)
            end = start + length
            for index in bucket.slots:
                slot = self.slots[index]
                lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
                if lo < hi:
                    out.append(Piece(index, bucket.index, lo - slot.offset, hi - lo, at + lo - start))
        return out
