"""Block-sparse attention: the kernels against dense references (outputs and gradients), masks,
the modules, the padding helpers, memory, and bad input."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from ds_ops.sparse_attention import (
    BertSparseSelfAttention,
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparseAttentionConfig,
    SparseAttentionUtils,
    SparseSelfAttention,
    VariableSparsityConfig,
    pad_to_block_size,
    unpad,
)

TOL = {torch.float32: {"atol": 2e-5, "rtol": 1e-4}, torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
       torch.float16: {"atol": 5e-3, "rtol": 5e-3}}


def inputs(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype).requires_grad_() for _ in range(3)]


def reference(q, k, v, layout=None, block=16, causal=False, key_padding=None, bias=None, scale=None):
    """Masked dense attention in float64: scores outside the layout are -inf; a query with every
    key masked gets 0 (the kernels' rule)."""
    q, k, v = (t.double() for t in (q, k, v))
    seq = q.shape[2]
    scores = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if bias is not None:
        scores = scores + bias.double()
    if key_padding is not None:
        scores = scores + key_padding.double()[:, None, None, :]
    keep = torch.ones(seq, seq, dtype=torch.bool)
    if layout is not None:
        keep = layout.bool().repeat_interleave(block, 1).repeat_interleave(block, 2)
    if causal:
        keep = keep & torch.ones(seq, seq, dtype=torch.bool).tril()
    scores = scores.masked_fill(~keep, float("-inf"))
    dead = (scores == float("-inf")).all(-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(dead, 0.0), -1).masked_fill(dead, 0.0)
    return probs @ v


def run_both(module, shape, dtype=torch.float32, ref_kwargs=None, seed=0, **kwargs):
    """Forward and backward through `module` and `reference`; returns (ours, theirs) pairs."""
    q, k, v = inputs(shape, dtype, seed)
    out = module(q, k, v, **kwargs)
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference(qr, kr, vr, **(ref_kwargs or {}))
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    out.backward(grad.to(dtype))
    ref.backward(grad)
    return [(out, ref), (q.grad, qr.grad), (k.grad, kr.grad), (v.grad, vr.grad)]


def assert_pairs_close(pairs, dtype):
    for ours, theirs in pairs:
        assert ours.dtype == dtype
        torch.testing.assert_close(ours.double(), theirs, **TOL[dtype])


# ---- dense layouts against torch's SDPA ---------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape, block", [((1, 2, 64, 64), 16), ((3, 2, 96, 40), 16), ((2, 1, 64, 72), 32)])
def test_dense_layout_equals_sdpa_with_gradients(dtype, shape, block):
    """Odd batch sizes and head_dims that are not a multiple of the vector width (the tails)."""
    module = SparseSelfAttention(DenseSparsityConfig(num_heads=shape[1], block=block), max_seq_length=128)
    q, k, v = inputs(shape, dtype)
    out = module(q, k, v)
    qs, ks, vs = (t.detach().float().requires_grad_() for t in (q, k, v))
    expected = F.scaled_dot_product_attention(qs, ks, vs)
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    out.backward(grad.to(dtype))
    expected.backward(grad)
    for ours, theirs in ((out, expected), (q.grad, qs.grad), (k.grad, ks.grad), (v.grad, vs.grad)):
        torch.testing.assert_close(ours.float(), theirs, **TOL[dtype])


def test_dense_causal_equals_sdpa_is_causal():
    module = SparseSelfAttention(DenseSparsityConfig(num_heads=2), max_seq_length=64)
    q, k, v = inputs((2, 2, 64, 32))
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, expected = module(q, k, v, causal=True), F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
    out.sum().backward()
    expected.sum().backward()
    for ours, theirs in ((out, expected), (q.grad, qs.grad), (k.grad, ks.grad), (v.grad, vs.grad)):
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)


# ---- sparse layouts against the masked dense reference -------------------------------------------

LAYOUTS = {
    "fixed": lambda h: FixedSparsityConfig(h, num_local_blocks=2),
    "fixed-unidirectional": lambda h: FixedSparsityConfig(h, num_local_blocks=2, attention="unidirectional"),
    "fixed-horizontal-per-head": lambda h: FixedSparsityConfig(
        h, num_local_blocks=4, num_global_blocks=1, horizontal_global_attention=True, different_layout_per_head=True,
        num_different_global_patterns=2),
    "variable": lambda h: VariableSparsityConfig(h, num_random_blocks=1, local_window_blocks=[1, 2],
                                                 global_block_indices=[0], different_layout_per_head=True),
    "bigbird": lambda h: BigBirdSparsityConfig(h, different_layout_per_head=True),
    "bigbird-unidirectional": lambda h: BigBirdSparsityConfig(h, attention="unidirectional"),
    "bslongformer": lambda h: BSLongformerSparsityConfig(h, global_block_indices=[0, 5]),
    "block32": lambda h: BigBirdSparsityConfig(h, block=32),
    "local-sliding-window": lambda h: LocalSlidingWindowSparsityConfig(h),
    "local-sliding-window-bidirectional": lambda h: LocalSlidingWindowSparsityConfig(
        h, num_sliding_window_blocks=5, attention="bidirectional"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sparse_layouts_equal_masked_dense_reference(name, dtype):
    torch.manual_seed(3)  # the random blocks
    config = LAYOUTS[name](2)
    module = SparseSelfAttention(config, max_seq_length=128)
    layout = module.get_layout(128)
    assert 0 < layout.density < 1 or name == "fixed-horizontal-per-head"
    causal = getattr(config, "attention", "") == "unidirectional"
    pairs = run_both(module, (3, 2, 128, 32), dtype,
                     {"layout": layout.layout, "block": config.block, "causal": causal})
    assert_pairs_close(pairs, dtype)


@pytest.mark.parametrize("attention, window", [("unidirectional", 3), ("bidirectional", 3), ("bidirectional", 4)])
def test_local_sliding_window_equals_dense_attention_under_its_token_mask(attention, window):
    """The mask is written token by token from the definition (not read from the layout): key j is
    visible to query i when their blocks are at most window // 2 apart, and j is not after i when
    unidirectional (causal inside the diagonal block too, SparseSelfAttention's default there)."""
    seq, block = 96, 16
    module = SparseSelfAttention(LocalSlidingWindowSparsityConfig(2, block=block, num_sliding_window_blocks=window,
                                                                  attention=attention), max_seq_length=128)
    qb, kb = torch.arange(seq)[:, None] // block, torch.arange(seq)[None, :] // block
    keep = (qb - kb).abs() <= window // 2
    if attention == "unidirectional":
        keep &= torch.arange(seq)[None, :] <= torch.arange(seq)[:, None]
    bias = torch.zeros(seq, seq).masked_fill(~keep, float("-inf"))
    for dtype in (torch.float32, torch.bfloat16):
        assert_pairs_close(run_both(module, (2, 2, seq, 32), dtype, {"bias": bias}), dtype)


def test_layout_is_cut_from_the_master_layout_and_cached():
    torch.manual_seed(0)
    module = SparseSelfAttention(BigBirdSparsityConfig(2), max_seq_length=256)
    short = module.get_layout(64)
    assert torch.equal(short.layout, module.master_layout[:, :4, :4])
    assert module.get_layout(64) is short
    pairs = run_both(module, (1, 2, 64, 16), ref_kwargs={"layout": short.layout})
    assert_pairs_close(pairs, torch.float32)


def test_compressed_layout_indexes_every_block_once():
    torch.manual_seed(1)
    module = SparseSelfAttention(BigBirdSparsityConfig(3, different_layout_per_head=True), max_seq_length=160)
    lay = module.get_layout(160)
    dense = lay.layout
    heads, nb, _ = dense.shape
    seen = torch.zeros_like(dense)
    for h in range(heads):
        for i in range(nb):
            for n in range(lay.row_ptr[h, i], lay.row_ptr[h, i + 1]):
                seen[h, i, lay.col_idx[n]] += 1
        for j in range(nb):  # the column index points at the same blocks
            for e in range(lay.col_ptr[h, j], lay.col_ptr[h, j + 1]):
                n = int(lay.csc_nnz[e])
                assert lay.col_idx[n] == j and lay.row_ptr[h, lay.csc_row[e]] <= n < lay.row_ptr[h, lay.csc_row[e] + 1]
    assert torch.equal(seen, dense) and lay.nnz == int(dense.sum())
    assert lay.max_row == int(dense.sum(2).max())


# ---- masks -------------------------------------------------------------------------------------

def test_key_padding_add_and_mul_modes_agree():
    shape, seq = (2, 2, 64, 16), 64
    keep = torch.ones(2, seq)
    keep[0, 40:] = 0
    keep[1, 5:9] = 0
    additive = torch.zeros(2, seq).masked_fill(keep == 0, -10000.0)
    outs = []
    for mode, mask in (("add", additive), ("mul", keep), ("mul", keep.bool())):
        module = SparseSelfAttention(DenseSparsityConfig(2), key_padding_mask_mode=mode, max_seq_length=seq)
        pairs = run_both(module, shape, key_padding_mask=mask,
                         ref_kwargs={"key_padding": torch.zeros(2, seq).masked_fill(keep == 0, float("-inf"))})
        assert_pairs_close(pairs, torch.float32)
        outs.append(pairs[0][0])
    torch.testing.assert_close(outs[0], outs[1])
    torch.testing.assert_close(outs[1], outs[2], rtol=0, atol=0)


def test_key_padding_in_transformers_extended_form():
    module = SparseSelfAttention(FixedSparsityConfig(2, num_local_blocks=2), max_seq_length=64)
    additive = torch.randn(3, 64)
    pairs = run_both(module, (3, 2, 64, 16), key_padding_mask=additive.view(3, 1, 1, 64),
                     ref_kwargs={"layout": module.get_layout(64).layout, "key_padding": additive})
    assert_pairs_close(pairs, torch.float32)


def test_attn_mask_and_rpe():
    seq = 64
    module = SparseSelfAttention(BigBirdSparsityConfig(2), max_seq_length=seq)  # attn_mask_mode="mul"
    keep = (torch.rand(seq, seq, generator=torch.Generator().manual_seed(2)) > 0.3).float()
    keep.fill_diagonal_(1.0)
    rpe = torch.randn(2, seq, seq)
    bias = torch.zeros(seq, seq).masked_fill(keep == 0, float("-inf")) + rpe
    pairs = run_both(module, (2, 2, seq, 16), attn_mask=keep, rpe=rpe,
                     ref_kwargs={"layout": module.get_layout(seq).layout, "bias": bias})
    assert_pairs_close(pairs, torch.float32)
    additive = SparseSelfAttention(DenseSparsityConfig(2), attn_mask_mode="add", max_seq_length=seq)
    shared_rpe = torch.randn(seq, seq)
    pairs = run_both(additive, (1, 2, seq, 16), attn_mask=rpe[0], rpe=shared_rpe,
                     ref_kwargs={"bias": rpe[0] + shared_rpe})
    assert_pairs_close(pairs, torch.float32)


def test_unidirectional_layout_is_causal_by_default_and_can_opt_out():
    config = FixedSparsityConfig(2, num_local_blocks=2, attention="unidirectional")
    module = SparseSelfAttention(config, max_seq_length=64)
    layout = module.get_layout(64).layout
    assert_pairs_close(run_both(module, (1, 2, 64, 16), ref_kwargs={"layout": layout, "causal": True}), torch.float32)
    pairs = run_both(module, (1, 2, 64, 16), causal=False, ref_kwargs={"layout": layout, "causal": False})
    assert_pairs_close(pairs, torch.float32)


def test_a_query_with_every_key_masked_gets_zero_not_nan():
    module = SparseSelfAttention(DenseSparsityConfig(1), key_padding_mask_mode="mul", max_seq_length=32)
    q, k, v = inputs((2, 1, 32, 16))
    mask = torch.ones(2, 32)
    mask[1] = 0  # batch 1: nothing to attend to
    out = module(q, k, v, key_padding_mask=mask)
    out.sum().backward()
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    for t in (out, q.grad, k.grad, v.grad):
        assert torch.isfinite(t).all()
    assert torch.equal(k.grad[1], torch.zeros_like(k.grad[1]))


def test_custom_scale():
    module = SparseSelfAttention(DenseSparsityConfig(2), max_seq_length=32)
    assert_pairs_close(run_both(module, (1, 2, 32, 16), scale=0.3, ref_kwargs={"scale": 0.3}), torch.float32)


# ---- execution paths ---------------------------------------------------------------------------

def test_strided_inputs_from_a_projection_layout():
    """[batch, seq, heads, dim] projections viewed as [batch, heads, seq, dim]: no copy needed."""
    module = SparseSelfAttention(BigBirdSparsityConfig(2), max_seq_length=64)
    base = torch.randn(2, 64, 2, 16)
    strided = base.transpose(1, 2)
    assert not strided.is_contiguous()
    torch.testing.assert_close(module(strided, strided, strided), module(*(strided.contiguous(),) * 3), rtol=0, atol=0)
    odd_last = torch.randn(2, 2, 16, 64).transpose(2, 3)  # last dim not contiguous: copied, same result
    torch.testing.assert_close(module(odd_last, odd_last, odd_last), module(*(odd_last.contiguous(),) * 3))


def test_inference_path_without_saved_probabilities_matches():
    module = SparseSelfAttention(FixedSparsityConfig(2, num_local_blocks=2), max_seq_length=64)
    q, k, v = inputs((2, 2, 64, 16))
    with torch.no_grad():
        plain = module(q, k, v)
    torch.testing.assert_close(plain, module(q, k, v).detach(), rtol=0, atol=0)


def test_buffers_stay_float32_under_another_default_dtype():
    """The kernels read the probabilities and masks as float32 whatever torch's default dtype is."""
    module = SparseSelfAttention(DenseSparsityConfig(2), key_padding_mask_mode="mul", max_seq_length=32)
    keep = torch.ones(1, 32)
    keep[0, 20:] = 0
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        pairs = run_both(module, (1, 2, 32, 16), key_padding_mask=keep,
                         ref_kwargs={"key_padding": torch.zeros(1, 32).masked_fill(keep == 0, float("-inf"))})
    finally:
        torch.set_default_dtype(default)
    assert_pairs_close(pairs, torch.float32)


def test_results_do_not_depend_on_the_thread_count():
    module = SparseSelfAttention(BigBirdSparsityConfig(2), max_seq_length=128)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            q, k, v = inputs((2, 2, 128, 32))
            out = module(q, k, v)
            out.sum().backward()
            results.append((out, q.grad, k.grad, v.grad))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


def test_saved_memory_scales_with_the_layout_not_seq_squared():
    torch.manual_seed(0)
    module = SparseSelfAttention(BigBirdSparsityConfig(2), max_seq_length=512)
    q, k, v = inputs((1, 2, 512, 16))
    out = module(q, k, v)
    saved = out.grad_fn.saved_tensors
    layout = module.get_layout(512)
    biggest = max(t.numel() for t in saved)
    assert biggest == max(layout.nnz * 16 * 16, q.numel())
    assert layout.nnz * 16 * 16 < 2 * 512 * 512 / 5  # well below the two heads' seq x seq


def test_second_backward_through_the_graph_is_refused():
    module = SparseSelfAttention(DenseSparsityConfig(1), max_seq_length=32)
    q, k, v = inputs((1, 1, 32, 16))
    out = module(q, k, v)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_works_inside_a_trained_model():
    """The layer learns: SGD moves it toward a teacher of the same shape."""
    config = SimpleNamespace(hidden_size=32, num_attention_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    teacher = BertSparseSelfAttention(config, BigBirdSparsityConfig(2))
    layer = BertSparseSelfAttention(config, BigBirdSparsityConfig(2))
    layer.sparse_self_attention.master_layout = teacher.sparse_self_attention.master_layout
    x = torch.randn(4, 64, 32)
    with torch.no_grad():
        target = teacher(x)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    losses = []
    for _ in range(40):
        loss = F.mse_loss(layer(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.2


# ---- the BERT layer and the padding helpers -----------------------------------------------------

def test_bert_layer_with_dense_layout_equals_standard_attention():
    config = SimpleNamespace(hidden_size=64, num_attention_heads=4, max_position_embeddings=100)
    layer = BertSparseSelfAttention(config, DenseSparsityConfig(num_heads=4))
    assert layer.sparse_self_attention.max_seq_length == 96  # cut to a multiple of the block
    x = torch.randn(3, 48, 64)
    keep = torch.ones(3, 48)
    keep[2, 30:] = 0
    extended = (1.0 - keep)[:, None, None, :] * -10000.0  # Transformers' extended attention mask
    out = layer(x, extended)

    def heads(t):
        return t.view(3, 48, 4, 16).transpose(1, 2)

    q, k, v = heads(layer.query(x)), heads(layer.key(x)), heads(layer.value(x))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=extended).transpose(1, 2).reshape(3, 48, 64)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


def test_padding_round_trip_through_sparse_attention():
    block, seq = 16, 37
    ids = torch.randint(1, 100, (2, seq))
    types = torch.zeros(2, seq, dtype=torch.long)
    positions = torch.arange(seq).expand(2, seq)
    pad_len, ids_p, mask_p, types_p, pos_p, embeds = pad_to_block_size(block, ids, None, types, positions,
                                                                       pad_token_id=0)
    assert pad_len == 11 and ids_p.shape == (2, 48) and embeds is None
    assert torch.equal(ids_p[:, :seq], ids) and torch.equal(ids_p[:, seq:], torch.zeros(2, 11, dtype=torch.long))
    assert torch.equal(mask_p, torch.cat([torch.ones(2, seq), torch.zeros(2, 11)], 1).long())
    assert types_p.shape == pos_p.shape == (2, 48)
    # the real tokens' outputs equal unpadded attention when the padding is masked
    embedding = torch.nn.Embedding(100, 32)
    x = embedding(ids_p).view(2, 48, 2, 16).transpose(1, 2)
    module = SparseSelfAttention(DenseSparsityConfig(2), key_padding_mask_mode="mul", max_seq_length=64)
    out = unpad(pad_len, module(x, x, x, key_padding_mask=mask_p).transpose(1, 2))
    xs = x[:, :, :seq]
    expected = F.scaled_dot_product_attention(xs, xs, xs).transpose(1, 2)
    assert out.shape == (2, seq, 2, 16)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


def test_padding_embeddings_and_no_op_cases():
    embedding = torch.nn.Embedding(10, 8)
    embeds = torch.randn(2, 20, 8)
    pad_len, _, mask, _, _, padded = pad_to_block_size(16, inputs_embeds=embeds, pad_token_id=3,
                                                       model_embeddings=embedding)
    assert pad_len == 12 and padded.shape == (2, 32, 8)
    torch.testing.assert_close(padded[:, 20:], embedding(torch.full((2, 12), 3)))
    assert mask.sum().item() == 40
    ids = torch.ones(1, 32, dtype=torch.long)
    assert pad_to_block_size(16, ids)[0] == 0
    assert unpad(0, ids) is ids
    assert SparseAttentionUtils.unpad_sequence_output(4, torch.zeros(1, 10)).shape == (1, 6)


# ---- the config section drives the module --------------------------------------------------------

def test_config_section_builds_a_working_module():
    section = SparseAttentionConfig.model_validate({"mode": "bslongformer", "block": 16,
                                                     "num_sliding_window_blocks": 3, "global_block_indices": [0]})
    module = SparseSelfAttention(section.sparsity_config(num_heads=2), max_seq_length=64)
    pairs = run_both(module, (1, 2, 64, 16), ref_kwargs={"layout": module.get_layout(64).layout})
    assert_pairs_close(pairs, torch.float32)


# ---- bad input ---------------------------------------------------------------------------------

def test_bad_inputs_are_named():
    module = SparseSelfAttention(DenseSparsityConfig(2), max_seq_length=64)
    good = torch.randn(1, 2, 32, 16)
    cases = [
        ((torch.randn(1, 3, 32, 16),) * 3, {}, "has 3 heads but the sparsity config was made for num_heads=2"),
        ((torch.randn(1, 2, 40, 16),) * 3, {}, "sequence length 40 is not a multiple of the block 16"),
        ((torch.randn(1, 2, 80, 16),) * 3, {}, "sequence length 80 exceeds max_seq_length=64"),
        ((good.double(),) * 3, {}, "query, key and value must all be torch.float32, torch.bfloat16 or torch.float16"),
        ((good, good.bfloat16(), good), {}, "key is torch.bfloat16"),
        ((good, torch.randn(1, 2, 32, 8), good), {}, "key has shape (1, 2, 32, 8)"),
        ((torch.randn(2, 32, 16),) * 3, {}, "query must be a [batch, heads, seq, head_dim] tensor, got (2, 32, 16)"),
        ((good.to("meta"),) * 3, {}, "query is on meta: the sparse attention kernels of this build run on CPU"),
        ((good,) * 3, {"key_padding_mask": torch.zeros(2, 32)}, "key_padding_mask must be [batch, seq] = [1, 32]"),
        ((good,) * 3, {"key_padding_mask": torch.ones(1, 32, dtype=torch.bool)}, "key_padding_mask_mode='mul'"),
        ((good,) * 3, {"attn_mask": torch.ones(32, 31)}, "attn_mask must be [seq, seq] = [32, 32]"),
        ((good,) * 3, {"rpe": torch.ones(3, 32, 32)}, "rpe must be [seq, seq] or [heads, seq, seq]"),
        ((good,) * 3, {"scale": float("nan")}, "scale must be a finite number, got nan"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            module(*args, **kwargs)


def test_bad_construction_is_named():
    with pytest.raises(ValueError, match=re.escape("key_padding_mask_mode must be one of ('add', 'mul'), got 'max'")):
        SparseSelfAttention(DenseSparsityConfig(2), key_padding_mask_mode="max")
    with pytest.raises(ValueError, match="attn_mask_mode must be one of"):
        SparseSelfAttention(DenseSparsityConfig(2), attn_mask_mode=None)
    with pytest.raises(ValueError, match="block must be a multiple of 16 up to 128 for the kernels, got 8"):
        SparseSelfAttention(DenseSparsityConfig(2, block=8))
    with pytest.raises(ValueError, match=re.escape("max_seq_length must be a positive multiple of the block (16), got 100")):
        SparseSelfAttention(DenseSparsityConfig(2), max_seq_length=100)
    with pytest.raises(TypeError, match="sparsity_config must be a SparsityConfig, got dict"):
        SparseSelfAttention({"mode": "fixed"})
    with pytest.raises(ValueError, match=r"config.hidden_size \(30\) must be a multiple of config.num_attention_heads \(4\)"):
        BertSparseSelfAttention(SimpleNamespace(hidden_size=30, num_attention_heads=4))
    with pytest.raises(ValueError, match=r"sparsity_config.num_heads \(2\) must equal config.num_attention_heads \(4\)"):
        BertSparseSelfAttention(SimpleNamespace(hidden_size=32, num_attention_heads=4), DenseSparsityConfig(2))
    with pytest.raises(ValueError, match="padding inputs_embeds needs model_embeddings"):
        pad_to_block_size(16, inputs_embeds=torch.zeros(1, 3, 4))
    with pytest.raises(ValueError, match="pad_len 5 exceeds the sequence length 3"):
        unpad(5, torch.zeros(1, 3))


def test_kernel_refuses_bad_shapes_itself():
    from ds_ops.op_builder import SparseAttentionBuilder
    kernel = SparseAttentionBuilder().load()
    zero = (0, 0, 0, 0)
    with pytest.raises(ValueError, match=re.escape("block must be 16, 32, 48, ... or 128, got 8")):
        kernel.forward(zero, zero, zero, zero, 0, (1, 1, 32, 16, 8), (0,) * 7, (0,) * 5, 1.0, False, 0, 1)
    with pytest.raises(ValueError, match="sequence length 40 is not a multiple of the block 16"):
        kernel.forward(zero, zero, zero, zero, 0, (1, 1, 40, 16, 16), (0,) * 7, (0,) * 5, 1.0, False, 0, 1)
    with pytest.raises(ValueError, match="probabilities are missing"):
        kernel.backward(zero, zero, zero, zero, zero, zero, zero, 0, (1, 1, 32, 16, 16), (0,) * 7, 1.0, 0, 1)


# ---- the portable builds -----------------------------------------------------------------------

SIMD_CHECK = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from ds_ops.op_builder import SparseAttentionBuilder
    from ds_ops.sparse_attention import DenseSparsityConfig, SparseSelfAttention
    print("SIMD", SparseAttentionBuilder().load().simd_level())
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 64, 40, generator=g).requires_grad_() for _ in range(3))
    q.data[0, 0, 0] *= 40  # large scores: exp over a wide range, down to underflow
    module = SparseSelfAttention(DenseSparsityConfig(2), key_padding_mask_mode="mul", max_seq_length=64)
    mask = torch.ones(2, 64); mask[1, 50:] = 0
    out = module(q, k, v, key_padding_mask=mask, causal=True)
    out.sum().backward()
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    allowed = torch.ones(64, 64, dtype=torch.bool).tril() & mask.bool()[:, None, None, :]
    ref = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed)
    ref.sum().backward()
    for a, b in ((out, ref), (q.grad, qs.grad), (k.grad, ks.grad), (v.grad, vs.grad)):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4)
    print("OK")
""")


@pytest.mark.parametrize("level, expected", [("avx2", "AVX2"), ("scalar", "scalar")])
def test_portable_simd_builds_compute_the_same(level, expected):
    # in the session's op cache, where the kernel matrix builds the same portable level
    result = subprocess.run([sys.executable, "-c", SIMD_CHECK], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "DS_BUILD_SIMD": level})
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SIMD {expected}" in result.stdout and "OK" in result.stdout
