"""`MatMul` and `Softmax`: DeepSpeed's standalone block-sparse ops (``deepspeed.ops.sparse_attention``'s
``MatMul(layout, block, mode, trans_a, trans_b)`` and ``Softmax(layout, block)``, Triton kernels in
DeepSpeed), written in PyTorch: gathers of the layout's blocks, batched matmuls and index-adds. They
run on any device and dtype torch's matmul runs, and autograd differentiates them (the
`SparseSelfAttention` module has fused C++ kernels; these are the building blocks for other uses).

A block-sparse tensor is ``[batch, nnz, block, block]``: the blocks of the layout's nonzero
entries in the order of ``layout.nonzero()`` (head, block row, block column), as DeepSpeed stores
them. A layout is ``[heads, rows, cols]`` (or ``[rows, cols]``, one head) of 0s and 1s; a dense
operand is ``[batch, heads, m, n]`` (fewer dimensions get leading ones, as in DeepSpeed).

    sdd = MatMul(layout, 16, "sdd", trans_b=True)   # scores = q @ k^T at the layout's blocks only
    softmax = Softmax(layout, 16)
    dsd = MatMul(layout, 16, "dsd")                 # out = probs @ v
    out = dsd(softmax(sdd(q, k), scale=q.shape[-1] ** -0.5), v)
"""

from __future__ import annotations

import math
import numbers
import time

import torch

MODES = ("sdd", "dsd", "dds")
MASK_MODES = ("add", "mul")


class _Layout:
    """A checked layout ``[heads, rows, cols]`` and the (head, row, col) of its nonzero blocks."""

    def __init__(self, owner: str, layout, block):
        if not isinstance(layout, torch.Tensor) or layout.dim() not in (2, 3):
            got = f"shape {tuple(layout.shape)}" if isinstance(layout, torch.Tensor) else type(layout).__name__
            raise ValueError(f"{owner}: layout must be a [rows, cols] or [heads, rows, cols] tensor of 0s and 1s, "
                             f"got {got}")
        if isinstance(block, bool) or not isinstance(block, numbers.Integral) or block < 1:
            raise ValueError(f"{owner}: block must be a positive integer, got {block!r}")
        cpu = layout.detach().to("cpu")
        if cpu.is_complex() or not bool(((cpu == 0) | (cpu == 1)).all()):
            raise ValueError(f"{owner}: layout values must be 0 or 1, got {torch.unique(cpu)[:6].tolist()}")
        cpu = cpu.to(torch.int64)
        self.blocks = cpu if cpu.dim() == 3 else cpu.unsqueeze(0)
        if min(self.blocks.shape) == 0:
            raise ValueError(f"{owner}: layout has an empty dimension: {tuple(layout.shape)}")
        self.block = int(block)
        self.heads, self.rows, self.cols = self.blocks.shape
        self.nnz = int(self.blocks.sum())
        self._indices: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def indices(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """head, block row and block column of each nonzero block, on ``device`` (cached)."""
        if device not in self._indices:
            h, i, j = self.blocks.nonzero(as_tuple=True)
            self._indices[device] = (h.to(device), i.to(device), j.to(device))
        return self._indices[device]


def _elapsed_ms(start: float, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def _pad_dims(owner: str, name: str, t: torch.Tensor) -> torch.Tensor:
    if t.dim() > 4:
        raise ValueError(f"{owner}: {name} has {t.dim()} dimensions; at most 4 ([batch, heads, ...]) are supported")
    return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))


class MatMul:
    """Block-sparse matrix product (DeepSpeed's ``MatMul``): ``c = op(a) @ op(b)``, ``op`` a
    transpose of the last two dimensions where ``trans_a`` / ``trans_b`` ask for it.

    ``mode``: ``"sdd"`` sparse = dense x dense (``c`` holds the product's blocks at the layout's
    nonzeros, ``[batch, nnz, block, block]``); ``"dsd"`` dense = sparse x dense (``a`` is
    block-sparse: the matrix the layout describes, transposed when ``trans_a``); ``"dds"`` dense =
    dense x sparse (``b`` is). Dense operands are ``[batch, heads, m, n]`` with ``heads`` the
    layout's; batch dimensions of size 1 broadcast. Under autocast both inputs are cast to the
    autocast dtype, as DeepSpeed casts them to float16. ``bench=True`` sets ``time_c`` to each
    call's wall time in milliseconds (``time_da``/``time_db`` stay None: the backward is autograd's).
    """

    def __init__(self, layout, block: int, mode: str, trans_a: bool = False, trans_b: bool = False,
                 bench: bool = False):
        if mode not in MODES:
            raise ValueError(f"MatMul: mode must be one of {MODES}, got {mode!r}")
        for name, value in (("trans_a", trans_a), ("trans_b", trans_b), ("bench", bench)):
            if not isinstance(value, bool):
                raise ValueError(f"MatMul: {name} must be True or False, got {value!r}")
        self._layout = _Layout("MatMul", layout, block)
        self.layout, self.block, self.mode = layout, int(block), mode
        self.trans_a, self.trans_b, self.bench = trans_a, trans_b, bench
        self.spdims = tuple(self._layout.blocks.shape)
        self.time_c = self.time_da = self.time_db = None

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        for name, t in (("a", a), ("b", b)):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise ValueError(f"MatMul: {name} must be a floating-point tensor, got "
                                 f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
        if a.device != b.device:
            raise ValueError(f"MatMul: the inputs must be on one device; got {a.device} for a and {b.device} for b")
        if torch.is_autocast_enabled(a.device.type):
            dtype = torch.get_autocast_dtype(a.device.type)
            a, b = a.to(dtype), b.to(dtype)
        elif a.dtype != b.dtype:
            raise ValueError(f"MatMul: the inputs must share one dtype; got {a.dtype} for a and {b.dtype} for b")
        original_dims = max(a.dim(), b.dim())
        a, b = _pad_dims("MatMul", "a", a), _pad_dims("MatMul", "b", b)
        start = time.perf_counter()
        c = {"sdd": self._sdd, "dsd": self._dsd, "dds": self._dds}[self.mode](a, b)
        if self.bench:
            self.time_c = _elapsed_ms(start, c.device)
        while c.dim() > original_dims and c.shape[0] == 1:  # drop the leading ones the inputs lacked
            c = c.squeeze(0)
        return c

    # -- the three products ------------------------------------------------------------------------------

    def _check_sparse(self, name: str, t: torch.Tensor) -> None:
        lay = self._layout
        if tuple(t.shape[1:]) != (lay.nnz, lay.block, lay.block):
            raise ValueError(f"MatMul: {name} is the block-sparse operand of mode {self.mode!r} and must be "
                             f"[batch, nnz, block, block] = [batch, {lay.nnz}, {lay.block}, {lay.block}], "
                             f"got {tuple(t.shape)}")

    def _check_dense(self, name: str, t: torch.Tensor, dim: int, size: int, what: str) -> None:
        """``t`` is op(name): [batch, heads, rows, cols] after the transpose ``trans_<name>`` asks for."""
        lay = self._layout
        shown = f"op({name})" if getattr(self, f"trans_{name}") else name
        if t.shape[1] != lay.heads:
            raise ValueError(f"MatMul: {shown} has {t.shape[1]} heads (dimension 1 of {tuple(t.shape)}), "
                             f"the layout {lay.heads}")
        if t.shape[dim] != size:
            raise ValueError(f"MatMul: {shown} must have {size} {what} (dimension {dim} of {tuple(t.shape)}), "
                             f"got {t.shape[dim]}")

    def _sdd(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        lay = self._layout
        a = a.transpose(2, 3) if self.trans_a else a  # [batch, heads, m, k]
        b = b.transpose(2, 3) if self.trans_b else b  # [batch, heads, k, n]
        self._check_dense("a", a, 2, lay.rows * lay.block, "rows (the layout's rows x block)")
        self._check_dense("b", b, 3, lay.cols * lay.block, "columns (the layout's columns x block)")
        self._check_dense("b", b, 2, a.shape[3], "rows (a's columns: the inner dimension)")
        batch = torch.broadcast_shapes(a.shape[:1], b.shape[:1])[0]
        a, b = a.expand(batch, *a.shape[1:]), b.expand(batch, *b.shape[1:])
        h, i, j = lay.indices(a.device)
        a_rows = a.unflatten(2, (lay.rows, lay.block))[:, h, i]  # [batch, nnz, block, k]
        b_cols = b.unflatten(3, (lay.cols, lay.block)).permute(0, 1, 3, 2, 4)[:, h, j]  # [batch, nnz, k, block]
        return torch.matmul(a_rows, b_cols)

    def _dsd(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        lay = self._layout
        self._check_sparse("a", a)
        h, i, j = lay.indices(a.device)
        blocks = a.transpose(2, 3) if self.trans_a else a  # the blocks of op(a)
        out_index, inner_index = (j, i) if self.trans_a else (i, j)
        out_blocks, inner_blocks = (lay.cols, lay.rows) if self.trans_a else (lay.rows, lay.cols)
        b = b.transpose(2, 3) if self.trans_b else b  # [batch, heads, k, n]
        self._check_dense("b", b, 2, inner_blocks * lay.block, "rows (op(a)'s columns: the inner dimension)")
        batch = torch.broadcast_shapes(blocks.shape[:1], b.shape[:1])[0]
        blocks, b = blocks.expand(batch, *blocks.shape[1:]), b.expand(batch, *b.shape[1:])
        b_rows = b.unflatten(2, (inner_blocks, lay.block))[:, h, inner_index]  # [batch, nnz, block, n]
        parts = torch.matmul(blocks, b_rows)  # [batch, nnz, block, n]
        n = b.shape[3]
        out = _sum_into(parts, (batch, lay.heads * out_blocks, lay.block, n), h * out_blocks + out_index)
        return out.reshape(batch, lay.heads, out_blocks * lay.block, n)

    def _dds(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        lay = self._layout
        self._check_sparse("b", b)
        h, i, j = lay.indices(b.device)
        blocks = b.transpose(2, 3) if self.trans_b else b  # the blocks of op(b)
        inner_index, out_index = (j, i) if self.trans_b else (i, j)
        inner_blocks, out_blocks = (lay.cols, lay.rows) if self.trans_b else (lay.rows, lay.cols)
        a = a.transpose(2, 3) if self.trans_a else a  # [batch, heads, m, k]
        self._check_dense("a", a, 3, inner_blocks * lay.block, "columns (op(b)'s rows: the inner dimension)")
        batch = torch.broadcast_shapes(a.shape[:1], blocks.shape[:1])[0]
        a, blocks = a.expand(batch, *a.shape[1:]), blocks.expand(batch, *blocks.shape[1:])
        a_cols = a.unflatten(3, (inner_blocks, lay.block)).permute(0, 1, 3, 2, 4)[:, h, inner_index]  # [b, nnz, m, B]
        parts = torch.matmul(a_cols, blocks)  # [batch, nnz, m, block]
        m = a.shape[2]
        out = _sum_into(parts, (batch, lay.heads * out_blocks, m, lay.block), h * out_blocks + out_index)
        out = out.reshape(batch, lay.heads, out_blocks, m, lay.block).permute(0, 1, 3, 2, 4)
        return out.reshape(batch, lay.heads, m, out_blocks * lay.block)


def _sum_into(parts: torch.Tensor, shape: tuple, index: torch.Tensor) -> torch.Tensor:
    """``parts`` [batch, nnz, ...] summed by ``index`` into a zero tensor of ``shape`` (dimension 1),
    accumulating 16-bit inputs in float32 as the Triton kernels do."""
    accumulate = torch.promote_types(parts.dtype, torch.float32)
    out = torch.zeros(shape, dtype=accumulate, device=parts.device).index_add(1, index, parts.to(accumulate))
    return out.to(parts.dtype)


class Softmax:
    """Softmax over the rows of a block-sparse tensor (DeepSpeed's ``Softmax``): each row runs over
    the nonzero blocks of its block row only, on ``x * scale + rpe + masks``, in float32 (float64
    for float64 input). In place, as DeepSpeed's: the result is written into ``x`` and ``x`` is
    returned (give it a tensor autograd may overwrite: not a leaf that requires grad).

    ``rpe`` (relative position scores): ``[seq_q, seq_k]``, ``[heads, seq_q, seq_k]`` or ``[batch,
    heads, seq_q, seq_k]`` (dimensions of 1 broadcast). ``key_padding_mask``: ``[batch, seq_k]`` (or
    ``[batch, 1, 1, seq_k]``). ``attn_mask``: ``[seq_q, seq_k]``. Mode ``"add"`` adds a mask to the
    scores, ``"mul"`` drops the positions where it is 0. A row whose positions are all dropped
    gets 0 (DeepSpeed's kernel gives nan). ``bench=True`` sets ``time_y`` to each call's wall time
    in milliseconds.
    """

    def __init__(self, layout, block: int, bench: bool = False):
        if not isinstance(bench, bool):
            raise ValueError(f"Softmax: bench must be True or False, got {bench!r}")
        self._layout = _Layout("Softmax", layout, block)
        self.layout, self.block, self.bench = layout, int(block), bench
        self.spdims = tuple(self._layout.blocks.shape)
        self.num_blocks = self._layout.nnz
        self.time_y = None

    def __call__(self, x: torch.Tensor, scale: float = 1.0, rpe=None, key_padding_mask=None, attn_mask=None,
                 key_padding_mask_mode: str = "add", attn_mask_mode: str = "add") -> torch.Tensor:
        lay = self._layout
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() not in (3, 4) \
                or tuple(x.shape[-3:]) != (lay.nnz, lay.block, lay.block):
            got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"Softmax: x must be a floating-point block-sparse tensor [batch, nnz, block, block] = "
                             f"[batch, {lay.nnz}, {lay.block}, {lay.block}], got {got}")
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
            raise ValueError(f"Softmax: scale must be a finite number, got {scale!r}")
        for name, mode in (("key_padding_mask_mode", key_padding_mask_mode), ("attn_mask_mode", attn_mask_mode)):
            if mode not in MASK_MODES:
                raise ValueError(f"Softmax: {name} must be one of {MASK_MODES}, got {mode!r}")
        if x.is_leaf and x.requires_grad and torch.is_grad_enabled():
            raise ValueError("Softmax works in place (as DeepSpeed's) and x is a leaf that requires grad; "
                             "pass x.clone() or the output of the op that made the scores")
        start = time.perf_counter()
        x4 = x if x.dim() == 4 else x.unsqueeze(0)
        batch = x4.shape[0]
        compute = torch.promote_types(x.dtype, torch.float32)
        h, i, j = lay.indices(x.device)
        offsets = torch.arange(lay.block, device=x.device)
        rows = i.unsqueeze(1) * lay.block + offsets  # [nnz, block]: each block's rows in the dense matrix
        cols = j.unsqueeze(1) * lay.block + offsets  # [nnz, block]: its columns
        scores = x4.to(compute) * float(scale)
        if rpe is not None:
            scores = scores + self._rpe(rpe, batch, compute)[:, self._head_index(rpe, h), rows[:, :, None],
                                                              cols[:, None, :]]
        if key_padding_mask is not None:
            mask = self._key_padding(key_padding_mask, key_padding_mask_mode, batch, compute)
            scores = scores + mask[:, cols].unsqueeze(2)  # [batch or 1, nnz, 1, block]
        if attn_mask is not None:
            mask = self._attn_mask(attn_mask, attn_mask_mode, compute)
            scores = scores + mask[rows[:, :, None], cols[:, None, :]]
        y = _block_row_softmax(scores, h * lay.rows + i, lay.heads * lay.rows)
        x4.copy_(y)
        if self.bench:
            self.time_y = _elapsed_ms(start, x.device)
        return x

    # -- masks ---------------------------------------------------------------------------------------------

    def _dense_shape(self) -> tuple[int, int]:
        return self._layout.rows * self.block, self._layout.cols * self.block

    def _rpe(self, rpe, batch: int, compute: torch.dtype) -> torch.Tensor:
        seq_q, seq_k = self._dense_shape()
        heads = self._layout.heads
        if not isinstance(rpe, torch.Tensor) or rpe.dim() not in (2, 3, 4) or tuple(rpe.shape[-2:]) != (seq_q, seq_k) \
                or (rpe.dim() >= 3 and rpe.shape[-3] not in (1, heads)) or (rpe.dim() == 4 and rpe.shape[0] not in (1, batch)):
            got = tuple(rpe.shape) if isinstance(rpe, torch.Tensor) else type(rpe).__name__
            raise ValueError(f"Softmax: rpe must be [seq_q, seq_k], [heads, seq_q, seq_k] or [batch, heads, seq_q, "
                             f"seq_k] = [{batch}, {heads}, {seq_q}, {seq_k}] (1 broadcasts), got {got}")
        return _pad_dims("Softmax", "rpe", rpe).to(compute)

    def _head_index(self, rpe: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        shared = rpe.dim() == 2 or rpe.shape[-3] == 1
        return torch.zeros_like(h)[:, None, None] if shared else h[:, None, None]

    def _key_padding(self, mask, mode: str, batch: int, compute: torch.dtype) -> torch.Tensor:
        seq_k = self._dense_shape()[1]
        if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[1:3] == (1, 1):
            mask = mask.reshape(mask.shape[0], mask.shape[3])  # Transformers' [batch, 1, 1, seq]
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[1] != seq_k \
                or mask.shape[0] not in (1, batch):
            got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"Softmax: key_padding_mask must be [batch, seq_k] = [{batch}, {seq_k}] (or [batch, 1, "
                             f"1, seq_k]), got {got}")
        return _additive("key_padding_mask", mask, mode, compute)

    def _attn_mask(self, mask, mode: str, compute: torch.dtype) -> torch.Tensor:
        seq_q, seq_k = self._dense_shape()
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (seq_q, seq_k):
            got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"Softmax: attn_mask must be [seq_q, seq_k] = [{seq_q}, {seq_k}], got {got}")
        return _additive("attn_mask", mask, mode, compute)


def _additive(name: str, mask: torch.Tensor, mode: str, compute: torch.dtype) -> torch.Tensor:
    """A mask as values to add to the scores: ``add`` as given, ``mul`` 0 -> -inf and else 0."""
    if mode == "mul":
        return torch.zeros(mask.shape, dtype=compute, device=mask.device).masked_fill(mask == 0, float("-inf"))
    if mask.dtype == torch.bool:
        raise ValueError(f"Softmax: {name} is a bool tensor but {name}_mode is 'add' (values added to the scores); "
                         f"pass {name}_mode='mul' for a keep/drop mask")
    return mask.to(compute)


def _block_row_softmax(scores: torch.Tensor, row_of_block: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Softmax of [batch, nnz, block, block] scores over each row's blocks (``row_of_block``: the row
    group of each block, of ``num_rows``); a row of -inf only gives 0."""
    batch, _, block, _ = scores.shape
    block_max = scores.detach().amax(dim=3)  # [batch, nnz, block]; a constant shift: no gradient needed
    row_max = torch.full((batch, num_rows, block), float("-inf"), dtype=scores.dtype, device=scores.device)
    row_max = row_max.scatter_reduce(1, row_of_block[None, :, None].expand_as(block_max), block_max, "amax")
    row_max = row_max.masked_fill(row_max == float("-inf"), 0.0)  # all dropped: exp(-inf - 0) = 0
    exp = torch.exp(scores - row_max[:, row_of_block].unsqueeze(3))
    sums = torch.zeros((batch, num_rows, block), dtype=scores.dtype, device=scores.device)
    sums = sums.index_add(1, row_of_block, exp.sum(dim=3))
    sums = sums.masked_fill(sums == 0, 1.0)
    return exp / sums[:, row_of_block].unsqueeze(3)
