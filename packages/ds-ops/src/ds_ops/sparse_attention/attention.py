"""`SparseSelfAttention` and `BertSparseSelfAttention`: attention that computes only the blocks of a
sparsity layout, on the ``sparse_attn`` C++ kernels (SDD, block-sparse softmax, DSD; forward and
backward), and the padding helpers for sequences that are not a multiple of the block.

Memory: the forward keeps the probabilities of the layout's blocks (``nnz * block^2`` float32) for
the backward, which overwrites them with their gradient; the kernels' scratch is O(seq * head_dim).
Nothing is seq x seq unless you pass a seq x seq mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..op_builder import SparseAttentionBuilder
from .sparsity_config import FixedSparsityConfig, SparsityConfig

MASK_MODES = ("add", "mul")
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@dataclass(frozen=True)
class BlockLayout:
    """A layout in the kernels' form: CSR over block rows and CSC over block columns, per head."""

    layout: torch.Tensor  # [heads, nb, nb] of 0/1
    block: int
    row_ptr: torch.Tensor  # int32 [heads, nb + 1], into the blocks numbered over all heads
    col_idx: torch.Tensor  # int32 [nnz]
    col_ptr: torch.Tensor  # int32 [heads, nb + 1]
    csc_row: torch.Tensor  # int32 [nnz]: query block of each block, by key block
    csc_nnz: torch.Tensor  # int32 [nnz]: its CSR number
    nnz: int
    max_row: int

    @classmethod
    def from_layout(cls, layout: torch.Tensor, block: int) -> BlockLayout:
        layout = (layout != 0).to(torch.int64)
        heads, nb, _ = layout.shape
        h, i, j = layout.nonzero(as_tuple=True)  # in (head, row, column) order
        nnz = int(h.numel())
        if nnz >= 2**31:
            raise ValueError(f"the layout has {nnz} blocks; the kernels index at most 2^31 - 1")

        def pointers(counts: torch.Tensor) -> torch.Tensor:  # [heads, nb] -> [heads, nb + 1]
            ends = torch.cat([torch.zeros(1, dtype=torch.int64), counts.reshape(-1).cumsum(0)])
            index = torch.arange(heads).unsqueeze(1) * nb + torch.arange(nb + 1)
            return ends[index].to(torch.int32).contiguous()

        by_column = torch.argsort((h * nb + j) * nb + i)
        return cls(layout=layout, block=block, row_ptr=pointers(layout.sum(2)), col_idx=j.to(torch.int32),
                   col_ptr=pointers(layout.sum(1)), csc_row=i[by_column].to(torch.int32),
                   csc_nnz=by_column.to(torch.int32), nnz=nnz,
                   max_row=int(layout.sum(2).max()) if nnz else 0)

    @property
    def density(self) -> float:
        """Fraction of the blocks that are computed."""
        return self.nnz / self.layout.numel()

    def pointers(self) -> tuple[int, ...]:
        return (self.row_ptr.data_ptr(), self.col_idx.data_ptr(), self.col_ptr.data_ptr(), self.csc_row.data_ptr(),
                self.csc_nnz.data_ptr(), self.nnz, self.max_row)


def _kernel():
    return SparseAttentionBuilder().load()


def _dense(t: torch.Tensor) -> tuple[int, int, int, int]:
    return (t.data_ptr(), t.stride(0), t.stride(1), t.stride(2))


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class _BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout: BlockLayout, key_padding, bias, scale: float, causal: bool, training: bool):
        batch, heads, seq, head_dim = q.shape
        shape = (batch, heads, seq, head_dim, layout.block)
        out = torch.empty(q.shape, dtype=q.dtype)
        needs_grad = training and any(ctx.needs_input_grad[:3])  # else P lives in per-thread row buffers
        probs = (torch.empty((batch, layout.nnz, layout.block, layout.block), dtype=torch.float32)
                 if needs_grad else None)
        masks = (0 if key_padding is None else key_padding.data_ptr(), 0 if key_padding is None else key_padding.stride(0),
                 0 if bias is None else bias.data_ptr(), 0 if bias is None or bias.shape[0] == 1 else bias.stride(0),
                 0 if bias is None else bias.stride(1))
        _kernel().forward(_dense(q), _dense(k), _dense(v), _dense(out), 0 if probs is None else probs.data_ptr(),
                          shape, layout.pointers(), masks, scale, causal, _DTYPE_CODES[q.dtype],
                          torch.get_num_threads())
        if needs_grad:
            ctx.save_for_backward(q, k, v, probs)
            ctx.layout, ctx.scale = layout, scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, probs = ctx.saved_tensors
        layout = ctx.layout
        grad_out = _rows_contiguous(grad_out.to(q.dtype))
        grads = [torch.empty(q.shape, dtype=q.dtype) for _ in range(3)]
        _kernel().backward(_dense(q), _dense(k), _dense(v), _dense(grad_out), *(_dense(g) for g in grads),
                           probs.data_ptr(), (*q.shape, layout.block), layout.pointers(), ctx.scale,
                           _DTYPE_CODES[q.dtype], torch.get_num_threads())
        # the probabilities now hold dS: a second backward through this graph must fail, not be wrong
        torch.autograd.graph.increment_version(probs)
        return (*grads, None, None, None, None, None, None)


def _additive(mask: torch.Tensor, mode: str, name: str) -> torch.Tensor:
    """A mask as float32 to add to the scores: ``add`` as given, ``mul`` 0 -> -inf, else 0."""
    if mode == "mul":
        return torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(mask == 0, float("-inf"))
    if mask.dtype == torch.bool:
        raise ValueError(f"{name} is a bool tensor but {name}_mode is 'add' (values added to the scores); "
                         f"build the module with {name}_mode='mul' for a keep/drop mask")
    return mask.to(torch.float32).contiguous()


class SparseSelfAttention(torch.nn.Module):
    """Block-sparse scaled dot-product attention (DeepSpeed's module of the same name).

    ``forward(query, key, value, rpe=None, key_padding_mask=None, attn_mask=None)`` takes
    ``[batch, heads, seq, head_dim]`` tensors (float32, bfloat16 or float16, on CPU) and returns the
    attention output of the same shape and dtype. ``seq`` must be a multiple of the block and at
    most ``max_seq_length`` (the layout is made once at that length and cut to each input, so
    random blocks stay the same between calls); pad with `pad_to_block_size`.

    Masks: ``key_padding_mask`` ``[batch, seq]`` (or Transformers' ``[batch, 1, 1, seq]``),
    ``attn_mask`` ``[seq, seq]``, ``rpe`` (relative position scores) ``[seq, seq]`` or
    ``[heads, seq, seq]``. Mode ``add`` adds the mask to the scores, ``mul`` drops the positions
    where it is 0. ``causal`` (default: the layout's ``attention == "unidirectional"``) also masks
    the later keys inside the diagonal blocks, which a unidirectional layout alone keeps. A query
    whose keys are all masked gets an output of 0.
    """

    def __init__(self, sparsity_config: SparsityConfig | None = None, key_padding_mask_mode: str = "add",
                 attn_mask_mode: str = "mul", max_seq_length: int = 2048):
        super().__init__()
        self.sparsity_config = FixedSparsityConfig(num_heads=4) if sparsity_config is None else sparsity_config
        if not isinstance(self.sparsity_config, SparsityConfig):
            raise TypeError(f"sparsity_config must be a SparsityConfig, got {type(sparsity_config).__name__}")
        for name, mode in (("key_padding_mask_mode", key_padding_mask_mode), ("attn_mask_mode", attn_mask_mode)):
            if mode not in MASK_MODES:
                raise ValueError(f"{name} must be one of {MASK_MODES}, got {mode!r}")
        block = self.sparsity_config.block
        if block % 16 != 0 or block > 128:
            raise ValueError(f"the sparsity config's block must be a multiple of 16 up to 128 for the kernels, got {block}")
        if not isinstance(max_seq_length, int) or max_seq_length < block or max_seq_length % block != 0:
            raise ValueError(f"max_seq_length must be a positive multiple of the block ({block}), got {max_seq_length!r}")
        self.key_padding_mask_mode = key_padding_mask_mode
        self.attn_mask_mode = attn_mask_mode
        self.max_seq_length = max_seq_length
        self.master_layout = self.sparsity_config.make_layout(max_seq_length)
        self._layouts: dict[int, BlockLayout] = {}

    def get_layout(self, seq_len: int) -> BlockLayout:
        """The layout cut to ``seq_len`` in the kernels' form (cached per length)."""
        block = self.sparsity_config.block
        if seq_len % block != 0:
            raise ValueError(f"sequence length {seq_len} is not a multiple of the block {block}: pad it with "
                             "ds_ops.sparse_attention.pad_to_block_size (and cut the output with unpad)")
        if seq_len > self.max_seq_length:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_length={self.max_seq_length} "
                             "of this SparseSelfAttention; build it with a larger max_seq_length")
        if seq_len not in self._layouts:
            nb = seq_len // block
            self._layouts[seq_len] = BlockLayout.from_layout(self.master_layout[:, :nb, :nb], block)
        return self._layouts[seq_len]

    def _check_inputs(self, query, key, value) -> None:
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"{name} must be a [batch, heads, seq, head_dim] tensor, got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
            if t.shape != query.shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, query has {tuple(query.shape)}; they must match")
            if t.dtype != query.dtype or t.dtype not in _DTYPE_CODES:
                raise ValueError(f"{name} is {t.dtype} (query {query.dtype}); query, key and value must all be "
                                 "torch.float32, torch.bfloat16 or torch.float16")
            if t.device.type != "cpu":
                raise ValueError(f"{name} is on {t.device}: the sparse attention kernels of this build run on CPU "
                                 "(no CUDA kernel is built yet); move the tensors to the CPU")
        if query.shape[1] != self.sparsity_config.num_heads:
            raise ValueError(f"query has {query.shape[1]} heads but the sparsity config was made for "
                             f"num_heads={self.sparsity_config.num_heads}")
        if min(query.shape) == 0:
            raise ValueError(f"query has an empty dimension: {tuple(query.shape)}")

    def _key_padding(self, mask, batch: int, seq: int) -> torch.Tensor | None:
        if mask is None:
            return None
        if mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1:  # Transformers' [batch, 1, 1, seq]
            mask = mask.reshape(mask.shape[0], mask.shape[3])
        if tuple(mask.shape) != (batch, seq):
            raise ValueError(f"key_padding_mask must be [batch, seq] = [{batch}, {seq}] (or [batch, 1, 1, seq]), "
                             f"got {tuple(mask.shape)}")
        return _additive(mask, self.key_padding_mask_mode, "key_padding_mask").contiguous()

    def _bias(self, rpe, attn_mask, heads: int, seq: int) -> torch.Tensor | None:
        bias = None
        if attn_mask is not None:
            if tuple(attn_mask.shape) != (seq, seq):
                raise ValueError(f"attn_mask must be [seq, seq] = [{seq}, {seq}], got {tuple(attn_mask.shape)}")
            bias = _additive(attn_mask, self.attn_mask_mode, "attn_mask").unsqueeze(0)
        if rpe is not None:
            if tuple(rpe.shape) not in ((seq, seq), (heads, seq, seq)):
                raise ValueError(f"rpe must be [seq, seq] or [heads, seq, seq] = [{heads}, {seq}, {seq}], "
                                 f"got {tuple(rpe.shape)}")
            rpe = rpe.to(torch.float32).reshape(-1, seq, seq)
            bias = rpe if bias is None else bias + rpe
        return None if bias is None else bias.contiguous()

    def forward(self, query, key, value, rpe=None, key_padding_mask=None, attn_mask=None, causal: bool | None = None,
                scale: float | None = None):
        self._check_inputs(query, key, value)
        batch, heads, seq, head_dim = query.shape
        layout = self.get_layout(seq)
        if causal is None:
            causal = getattr(self.sparsity_config, "attention", "bidirectional") == "unidirectional"
        scale = float(head_dim) ** -0.5 if scale is None else float(scale)
        training = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        if not math.isfinite(scale):
            raise ValueError(f"scale must be a finite number, got {scale}")
        return _BlockSparseAttention.apply(
            _rows_contiguous(query), _rows_contiguous(key), _rows_contiguous(value), layout,
            self._key_padding(key_padding_mask, batch, seq), self._bias(rpe, attn_mask, heads, seq), scale,
            bool(causal), training)


class BertSparseSelfAttention(torch.nn.Module):
    """A BERT-style self-attention layer on `SparseSelfAttention`: query/key/value projections of
    ``config.hidden_size`` split into ``config.num_attention_heads`` heads. ``forward(hidden_states,
    attention_mask=None)`` takes ``[batch, seq, hidden]`` and an additive key mask ``[batch, seq]``
    or ``[batch, 1, 1, seq]`` (Transformers' extended mask) and returns the context ``[batch, seq,
    hidden]``, as Transformers' ``BertSelfAttention`` does (without the attention probabilities).
    """

    def __init__(self, config, sparsity_config: SparsityConfig | None = None):
        super().__init__()
        hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
        if not isinstance(hidden, int) or not isinstance(heads, int) or heads < 1 or hidden % heads != 0:
            raise ValueError(f"config.hidden_size ({hidden}) must be a multiple of config.num_attention_heads ({heads})")
        if sparsity_config is None:
            sparsity_config = FixedSparsityConfig(num_heads=heads)
        if sparsity_config.num_heads != heads:
            raise ValueError(f"sparsity_config.num_heads ({sparsity_config.num_heads}) must equal "
                             f"config.num_attention_heads ({heads})")
        self.num_attention_heads = heads
        self.attention_head_size = hidden // heads
        self.all_head_size = hidden
        self.query = torch.nn.Linear(hidden, hidden)
        self.key = torch.nn.Linear(hidden, hidden)
        self.value = torch.nn.Linear(hidden, hidden)
        max_seq = getattr(config, "max_position_embeddings", 2048)
        max_seq = max(sparsity_config.block, max_seq - max_seq % sparsity_config.block)
        self.sparse_self_attention = SparseSelfAttention(sparsity_config, max_seq_length=max_seq)

    def transpose_for_scores(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        return x.view(batch, seq, self.num_attention_heads, self.attention_head_size).transpose(1, 2)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.all_head_size:
            raise ValueError(f"hidden_states must be [batch, seq, {self.all_head_size}], got {tuple(hidden_states.shape)}")
        q, k, v = (self.transpose_for_scores(layer(hidden_states)) for layer in (self.query, self.key, self.value))
        context = self.sparse_self_attention(q, k, v, key_padding_mask=attention_mask)
        batch, seq, _ = hidden_states.shape
        return context.transpose(1, 2).reshape(batch, seq, self.all_head_size)


def pad_to_block_size(block_size: int, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                      inputs_embeds=None, pad_token_id: int = 0, model_embeddings=None):
    """Pad a batch on the right to a multiple of ``block_size`` (DeepSpeed's
    ``SparseAttentionUtils.pad_to_block_size``). Returns ``(pad_len, input_ids, attention_mask,
    token_type_ids, position_ids, inputs_embeds)``; the padded positions get ``pad_token_id``,
    attention mask 0 (made of ones if none was given) and token type 0; padded embeddings are
    ``model_embeddings(pad_token_id)``. Cut the model's output back with `unpad`.
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    reference = input_ids if input_ids is not None else inputs_embeds
    if reference is None:
        raise ValueError("pad_to_block_size needs input_ids or inputs_embeds")
    batch, seq = reference.shape[:2]
    pad_len = (-seq) % block_size
    if pad_len == 0:
        return 0, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds
    if input_ids is not None:
        input_ids = F.pad(input_ids, (0, pad_len), value=pad_token_id)
    if inputs_embeds is not None:
        if model_embeddings is None:
            raise ValueError("padding inputs_embeds needs model_embeddings (the model's word embedding module)")
        pad_ids = torch.full((batch, pad_len), pad_token_id, dtype=torch.long, device=inputs_embeds.device)
        inputs_embeds = torch.cat([inputs_embeds, model_embeddings(pad_ids).to(inputs_embeds.dtype)], dim=1)
    if attention_mask is None:
        attention_mask = torch.ones((batch, seq), dtype=torch.long, device=reference.device)
    attention_mask = F.pad(attention_mask, (0, pad_len), value=0)
    if token_type_ids is not None:
        token_type_ids = F.pad(token_type_ids, (0, pad_len), value=0)
    if position_ids is not None:
        position_ids = F.pad(position_ids, (0, pad_len), value=pad_token_id)
    return pad_len, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds


def unpad(pad_len: int, sequence_output: torch.Tensor) -> torch.Tensor:
    """Drop the ``pad_len`` positions `pad_to_block_size` added: ``[batch, seq, ...]`` -> the original seq."""
    if not isinstance(pad_len, int) or pad_len < 0:
        raise ValueError(f"pad_len must be an integer >= 0, got {pad_len!r}")
    if pad_len > sequence_output.shape[1]:
        raise ValueError(f"pad_len {pad_len} exceeds the sequence length {sequence_output.shape[1]}")
    if pad_len == 0:
        return sequence_output
    return sequence_output[:, : sequence_output.shape[1] - pad_len]


class SparseAttentionUtils:
    """DeepSpeed's name for the padding helpers."""

    pad_to_block_size = staticmethod(pad_to_block_size)
    unpad_sequence_output = staticmethod(unpad)
