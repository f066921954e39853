"""One record per trained parameter (FSDP2's ``FSDPParam`` in its bookkeeping role): where the parameter
sits in the flat layout, which piece of it this rank holds, and where that piece lives in the partition, the
master copy and the tensor the optimizer steps (its run). Built once by `ZeroOptimizer` from its layout,
policy and runs; the checkpoint and DeepSpeed's state-access API read offsets here instead of working them
out again. Pure data."""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ._layout import FlatLayout, Piece, Slot


@dataclass(frozen=True)
class Range:
    """A range of one parameter's flattened elements this rank holds, and where it lives."""

    param_offset: int  # its first element in the flattened parameter
    numel: int  # 0: this rank holds none of it
    in_partition: int  # offset in the rank's partition (stages 1-3; NVMe files too); in the flat buffer at stage 0
    in_master: int  # offset in the master copy in RAM (the flat buffer where that is the master)
    run: int  # the stepped tensor holding it (its optimizer state); -1: none
    in_run: int  # offset in that tensor


NOTHING = Range(0, 0, 0, 0, -1, 0)


@dataclass(frozen=True)
class ParamRecord:
    """One trained parameter (see the module docstring)."""

    index: int  # in the optimizer's list of trained parameters (the layout's slots)
    param: Any  # the model's parameter
    slot: Slot  # where it sits in the flat layout
    group: Any  # the process group its pieces are reduced and assembled over (ZeRO's, or its replicas')
    shard: Range | None  # this rank's piece of it in the layout's shards (what a checkpoint writes); None: none
    held: Range  # what this rank holds and steps of it: the whole parameter when optimizer states are whole


class ParamRecords(Sequence[ParamRecord]):
    """The records of an optimizer's trained parameters, in its order, found by parameter too."""

    def __init__(self, records: list[ParamRecord]):
        self._records = records
        self._by_id = {id(r.param): r for r in records}

    def __getitem__(self, index: int) -> ParamRecord:  # type: ignore[override]
        return self._records[index]

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[ParamRecord]:
        return iter(self._records)

    def of(self, param: Any) -> ParamRecord | None:
        """``param``'s record, or None when the optimizer does not train it."""
        return self._by_id.get(id(param))

    def shards(self) -> Iterator[tuple[ParamRecord, Range]]:
        """The records of which this rank holds a piece in the layout's shards, with that piece."""
        return ((r, r.shard) for r in self._records if r.shard is not None)


def build_records(layout: FlatLayout, params: Sequence[Any], rank: int, *, sharded: bool, master_in_partition: bool,
                  shard_starts: Sequence[int], runs: Sequence[tuple[int, int, int, int]],
                  groups: Sequence[Any]) -> ParamRecords:
    """The records of ``params`` (laid out by ``layout``) on ``rank``. ``sharded``: optimizer states are
    sharded (stages 1-3; else the rank steps every element); ``master_in_partition``: the master copy is laid
    out as the rank's partition (else as the whole flat layout: the flat buffer is the master below stage 3);
    ``shard_starts``: each bucket's shard's offset in the partition; ``runs``: the stepped tensors (bucket,
    offset in the bucket's stepped range, length, group); ``groups``: each bucket's process group."""
    run_starts: list[list[tuple[int, int]]] = [[] for _ in layout.buckets]
    for i, (b, at, _, _) in enumerate(runs):
        run_starts[b].append((at, i))

    def position(bucket: int, offset: int) -> tuple[int, int]:
        """(run, offset in it) of element ``offset`` of ``bucket``'s stepped range."""
        starts = run_starts[bucket]
        i = bisect.bisect_right(starts, (offset, len(runs))) - 1
        return starts[i][1], offset - starts[i][0]

    def shard_range(piece: Piece) -> Range:
        slot, bucket = layout.slots[piece.index], layout.buckets[piece.bucket]
        flat = slot.offset + piece.param_offset
        in_master = piece.partition_offset if master_in_partition else flat
        in_step = piece.partition_offset - shard_starts[piece.bucket] if sharded else flat - bucket.offset
        return Range(piece.param_offset, piece.numel, piece.partition_offset, in_master, *position(piece.bucket, in_step))

    pieces = {piece.index: piece for piece in layout.pieces(rank)}
    records = []
    for index, (param, slot) in enumerate(zip(params, layout.slots, strict=True)):
        shard = shard_range(pieces[index]) if index in pieces else None
        if sharded:
            held = shard if shard is not None else NOTHING
        else:  # every rank steps every element: the whole parameter is "this rank's piece"
            bucket = layout.buckets[slot.bucket]
            held = Range(0, slot.numel, slot.offset, slot.offset, *position(slot.bucket, slot.offset - bucket.offset))
        records.append(ParamRecord(index, param, slot, groups[slot.bucket], shard, held))
    return ParamRecords(records)
