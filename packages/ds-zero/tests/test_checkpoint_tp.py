"""A tensor-parallel slice's ZeRO piece as runs of its whole parameter (no processes): every element of the
piece lands where torch's own slicing of the whole puts it, for every partition_dim, partition_stride (Megatron's
strided slices of fused weights) and piece boundary."""

from __future__ import annotations

import math

import pytest
import torch

from ds_zero._checkpoint_tp import Slice, tensor_parallel_slices


@pytest.mark.parametrize("full_shape,dim,size,stride", [((8, 6), 0, 2, 1), ((8, 6), 1, 2, 1), ((4, 6, 3), 1, 3, 1),
                                                         ((12,), 0, 4, 1), ((2, 3, 8), 2, 4, 1), ((12, 4), 0, 2, 3),
                                                         ((4, 12), 1, 2, 3), ((2, 12, 3), 1, 3, 2), ((12,), 0, 2, 3)])
def test_runs_place_each_element_of_a_piece_where_the_whole_holds_it(full_shape, dim, size, stride):
    whole = torch.arange(math.prod(full_shape)).reshape(full_shape)
    chunks = whole.tensor_split(stride * size, dim=dim)  # Megatron's strided slice: chunks rank, size + rank, ...
    for rank in range(size):
        local = torch.cat([chunks[j * size + rank] for j in range(stride)], dim=dim)
        piece = Slice(rank, size, dim, tuple(local.shape), stride)
        local = local.contiguous().reshape(-1)  # the slice, flattened
        assert piece.full_shape == full_shape and piece.numel == whole.numel()
        for start in range(local.numel()):
            for length in (1, 2, 5, local.numel() - start):
                length = min(length, local.numel() - start)
                runs = piece.runs(start, length)
                assert sum(n for _, _, n in runs) == length
                rebuilt = torch.cat([whole.reshape(-1)[at:at + n] for _, at, n in runs])
                assert torch.equal(rebuilt, local[start:start + length])
                assert [off for off, _, _ in runs] == [sum(n for _, _, n in runs[:i]) for i in range(len(runs))]


def test_marks_are_read_and_bad_ones_are_refused(monkeypatch):
    sliced, replicated = torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(3))
    sliced.tensor_model_parallel, sliced.partition_dim, sliced.partition_stride = True, 1, 1
    replicated.tensor_model_parallel = False
    assert tensor_parallel_slices([sliced, replicated], None) == {}  # no group: whole tensors
    strided = torch.nn.Parameter(torch.zeros(6, 3))
    strided.tensor_model_parallel, strided.partition_dim, strided.partition_stride = True, 0, 3
    bad_stride = torch.nn.Parameter(torch.zeros(4, 3))
    bad_stride.tensor_model_parallel, bad_stride.partition_dim, bad_stride.partition_stride = True, 0, 3
    bad_dim = torch.nn.Parameter(torch.zeros(4, 3))
    bad_dim.tensor_model_parallel, bad_dim.partition_dim = True, 2
    import ds_zero._checkpoint_tp as tp
    monkeypatch.setattr(tp, "_group_rank_size", lambda group: (1, 2))  # as on rank 1 of a tensor-parallel group of 2
    slices = tensor_parallel_slices([sliced, replicated], object())
    assert slices == {0: Slice(1, 2, 1, (4, 3))} and slices[0].full_shape == (4, 6)
    assert tensor_parallel_slices([strided], object()) == {0: Slice(1, 2, 0, (6, 3), 3)}
    with pytest.raises(ValueError, match=r"partition_stride 3; allowed: an int >= 1 that divides its size 4"):
        tensor_parallel_slices([bad_stride], object())
    with pytest.raises(ValueError, match="partition_dim is 2"):
        tensor_parallel_slices([bad_dim], object())
