"""Block-sparse MatMul (sdd, dsd, dds) and Softmax against dense PyTorch references: the sparse
operand densified with zeros outside the layout, the sparse result sampled at the layout's blocks."""

from __future__ import annotations

import itertools

import pytest
import torch

from ds_ops.sparse_attention import FixedSparsityConfig, MatMul, Softmax, SparseSelfAttention


def _layout(heads: int, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    layout = (torch.rand(heads, rows, cols, generator=torch.Generator().manual_seed(seed)) < 0.5).long()
    layout[:, 0, 0] = 1  # never empty
    layout[0, rows - 1, :] = 0  # an empty block row: its output rows are zeros
    return layout


def _densify(sparse: torch.Tensor, layout: torch.Tensor, block: int) -> torch.Tensor:
    """[batch, nnz, B, B] -> [batch, heads, rows*B, cols*B], zeros outside the layout (a loop over the blocks)."""
    heads, rows, cols = layout.shape
    dense = torch.zeros(sparse.shape[0], heads, rows * block, cols * block, dtype=sparse.dtype)
    for k, (h, i, j) in enumerate(layout.nonzero().tolist()):
        dense[:, h, i * block:(i + 1) * block, j * block:(j + 1) * block] = sparse[:, k]
    return dense


def _sample(dense: torch.Tensor, layout: torch.Tensor, block: int) -> torch.Tensor:
    """The blocks of ``dense`` at the layout's nonzeros, in layout.nonzero() order."""
    return torch.stack([dense[:, h, i * block:(i + 1) * block, j * block:(j + 1) * block]
                        for h, i, j in layout.nonzero().tolist()], dim=1)


def _op(t: torch.Tensor, trans: bool) -> torch.Tensor:
    return t.transpose(-1, -2) if trans else t


def _randn(*shape, dtype=torch.float64, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


HEADS, ROWS, COLS, BLOCK, BATCH, INNER = 2, 3, 4, 4, 2, 8
TRANS = list(itertools.product([False, True], repeat=2))


@pytest.mark.parametrize(("trans_a", "trans_b"), TRANS)
def test_sdd_is_the_dense_product_sampled_at_the_layout(trans_a, trans_b):
    layout = _layout(HEADS, ROWS, COLS)
    a = _randn(BATCH, HEADS, *((INNER, ROWS * BLOCK) if trans_a else (ROWS * BLOCK, INNER)))
    b = _randn(BATCH, HEADS, *((COLS * BLOCK, INNER) if trans_b else (INNER, COLS * BLOCK)), seed=1)
    c = MatMul(layout, BLOCK, "sdd", trans_a=trans_a, trans_b=trans_b)(a, b)
    assert c.shape == (BATCH, int(layout.sum()), BLOCK, BLOCK)
    torch.testing.assert_close(c, _sample(_op(a, trans_a) @ _op(b, trans_b), layout, BLOCK))


@pytest.mark.parametrize(("trans_a", "trans_b"), TRANS)
def test_dsd_is_the_dense_product_of_the_densified_operand(trans_a, trans_b):
    layout = _layout(HEADS, ROWS, COLS)
    a = _randn(BATCH, int(layout.sum()), BLOCK, BLOCK)
    inner = (ROWS if trans_a else COLS) * BLOCK
    b = _randn(BATCH, HEADS, *((5, inner) if trans_b else (inner, 5)), seed=1)
    c = MatMul(layout, BLOCK, "dsd", trans_a=trans_a, trans_b=trans_b)(a, b)
    expected = _op(_densify(a, layout, BLOCK), trans_a) @ _op(b, trans_b)
    assert c.shape == expected.shape
    torch.testing.assert_close(c, expected)


@pytest.mark.parametrize(("trans_a", "trans_b"), TRANS)
def test_dds_is_the_dense_product_of_the_densified_operand(trans_a, trans_b):
    layout = _layout(HEADS, ROWS, COLS)
    b = _randn(BATCH, int(layout.sum()), BLOCK, BLOCK, seed=1)
    inner = (COLS if trans_b else ROWS) * BLOCK
    a = _randn(BATCH, HEADS, *((inner, 5) if trans_a else (5, inner)))
    c = MatMul(layout, BLOCK, "dds", trans_a=trans_a, trans_b=trans_b)(a, b)
    expected = _op(a, trans_a) @ _op(_densify(b, layout, BLOCK), trans_b)
    assert c.shape == expected.shape
    torch.testing.assert_close(c, expected)


@pytest.mark.parametrize("mode", ["sdd", "dsd", "dds"])
@pytest.mark.parametrize(("trans_a", "trans_b"), TRANS)
def test_matmul_gradients_pass_gradcheck(mode, trans_a, trans_b):
    block, layout = 2, _layout(2, 2, 3, seed=3)
    nnz = int(layout.sum())
    sparse = _randn(1, nnz, block, block, seed=2).requires_grad_()
    if mode == "sdd":
        a = _randn(1, 2, *((3, 4) if trans_a else (4, 3)), seed=4).requires_grad_()
        b = _randn(1, 2, *((6, 3) if trans_b else (3, 6)), seed=5).requires_grad_()
    elif mode == "dsd":
        a, inner = sparse, (2 if trans_a else 3) * block
        b = _randn(1, 2, *((3, inner) if trans_b else (inner, 3)), seed=5).requires_grad_()
    else:
        b, inner = sparse, (3 if trans_b else 2) * block
        a = _randn(1, 2, *((inner, 3) if trans_a else (3, inner)), seed=4).requires_grad_()
    op = MatMul(layout, block, mode, trans_a=trans_a, trans_b=trans_b)
    assert torch.autograd.gradcheck(op, (a, b))


def test_matmul_gradients_match_the_dense_references_gradients():
    """The attention pattern in float32: dsd(probs, v) and sdd(q, k^T), gradients against dense ones."""
    layout = _layout(HEADS, ROWS, ROWS)
    q, k = (_randn(BATCH, HEADS, ROWS * BLOCK, 8, dtype=torch.float32, seed=s).requires_grad_() for s in (1, 2))
    scores = MatMul(layout, BLOCK, "sdd", trans_b=True)(q, k)
    weight = _randn(*scores.shape, dtype=torch.float32, seed=3)
    (scores * weight).sum().backward()
    q_ref, k_ref = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    dense = q_ref @ k_ref.transpose(-1, -2)
    (dense * _densify(weight, layout, BLOCK)).sum().backward()
    torch.testing.assert_close(q.grad, q_ref.grad)
    torch.testing.assert_close(k.grad, k_ref.grad)

    probs = _randn(BATCH, int(layout.sum()), BLOCK, BLOCK, dtype=torch.float32, seed=4).requires_grad_()
    v = _randn(BATCH, HEADS, ROWS * BLOCK, 8, dtype=torch.float32, seed=5).requires_grad_()
    out = MatMul(layout, BLOCK, "dsd")(probs, v)
    dense_probs = _densify(probs.detach(), layout, BLOCK).requires_grad_()
    v_ref = v.detach().clone().requires_grad_()
    out_weight = _randn(*out.shape, dtype=torch.float32, seed=6)
    (out * out_weight).sum().backward()
    ((dense_probs @ v_ref) * out_weight).sum().backward()
    torch.testing.assert_close(probs.grad, _sample(dense_probs.grad, layout, BLOCK))
    torch.testing.assert_close(v.grad, v_ref.grad)


def test_two_dimensional_layout_and_inputs():
    """A [rows, cols] layout is one head; 2-D inputs come back without the leading ones."""
    layout = _layout(1, 3, 3)[0]
    a, b = _randn(12, 8, dtype=torch.float32), _randn(8, 12, dtype=torch.float32, seed=1)
    c = MatMul(layout, 4, "sdd")(a, b)
    assert c.shape == (int(layout.sum()), 4, 4)
    torch.testing.assert_close(c, _sample((a @ b)[None, None], layout[None], 4)[0])


def test_bfloat16_matmul_is_close_to_the_float32_product():
    layout = _layout(HEADS, ROWS, COLS)
    a = _randn(BATCH, int(layout.sum()), BLOCK, BLOCK, dtype=torch.float32)
    b = _randn(BATCH, HEADS, COLS * BLOCK, 16, dtype=torch.float32, seed=1)
    c = MatMul(layout, BLOCK, "dsd")(a.bfloat16(), b.bfloat16())
    assert c.dtype == torch.bfloat16
    expected = _densify(a.bfloat16().float(), layout, BLOCK) @ b.bfloat16().float()
    torch.testing.assert_close(c.float(), expected, rtol=1e-2, atol=2e-2)  # bf16: 8-bit mantissa


# ---- Softmax ---------------------------------------------------------------------------------------------

def _dense_softmax(x, layout, block, scale=1.0, rpe=None, kp=None, attn=None, kp_mode="add", attn_mode="add"):
    """softmax over each dense row, positions outside the layout excluded (-inf), sampled at the layout."""
    keep = layout.repeat_interleave(block, 1).repeat_interleave(block, 2).bool()  # [heads, seq_q, seq_k]
    scores = _densify(x, layout, block) * scale
    if rpe is not None:
        scores = scores + rpe
    if kp is not None:
        scores = scores + (torch.where(kp == 0, float("-inf"), 0.0) if kp_mode == "mul" else kp)[:, None, None, :]
    if attn is not None:
        scores = scores + (torch.where(attn == 0, float("-inf"), 0.0) if attn_mode == "mul" else attn)
    scores = scores.masked_fill(~keep, float("-inf"))
    return _sample(torch.softmax(scores, dim=-1), layout, block)


def test_softmax_is_the_dense_softmax_over_the_layouts_positions():
    layout = _layout(HEADS, ROWS, ROWS)
    seq = ROWS * BLOCK
    x = _randn(BATCH, int(layout.sum()), BLOCK, BLOCK)
    rpe = _randn(HEADS, seq, seq, seed=1)
    kp = _randn(BATCH, seq, seed=2)
    attn = (torch.rand(seq, seq, generator=torch.Generator().manual_seed(3)) < 0.8).double()
    attn[:, 0] = 1  # every row keeps a position
    expected = _dense_softmax(x, layout, BLOCK, 0.5, rpe, kp, attn, "add", "mul")
    y = Softmax(layout, BLOCK)(x, scale=0.5, rpe=rpe, key_padding_mask=kp, attn_mask=attn, attn_mask_mode="mul")
    assert y is x  # in place, as DeepSpeed's
    torch.testing.assert_close(y, expected)
    # a row's probabilities over its blocks sum to 1 (rows with blocks at all)
    assert torch.allclose(_densify(y, layout, BLOCK).sum(-1)[:, layout.sum(-1).repeat_interleave(BLOCK, 1) > 0],
                          torch.ones((), dtype=torch.float64))


def test_softmax_masks_of_each_form():
    layout = _layout(HEADS, ROWS, ROWS)
    seq = ROWS * BLOCK
    x = _randn(BATCH, int(layout.sum()), BLOCK, BLOCK)
    rpe4 = _randn(BATCH, HEADS, seq, seq, seed=1)
    kp = (torch.rand(BATCH, seq, generator=torch.Generator().manual_seed(2)) < 0.7)
    kp[:, 0] = True
    softmax = Softmax(layout, BLOCK)
    expected = _dense_softmax(x, layout, BLOCK, 1.0, rpe4, kp.double(), None, "mul")
    torch.testing.assert_close(softmax(x.clone(), rpe=rpe4, key_padding_mask=kp, key_padding_mask_mode="mul"), expected)
    rpe2 = rpe4[0, 0]
    torch.testing.assert_close(softmax(x.clone(), rpe=rpe2, key_padding_mask=kp[:, None, None, :],
                                       key_padding_mask_mode="mul"),
                               _dense_softmax(x, layout, BLOCK, 1.0, rpe2, kp.double(), None, "mul"))


def test_a_row_with_every_position_dropped_is_zero():
    layout = torch.ones(1, 2, 2, dtype=torch.long)
    x = _randn(1, 4, 2, 2)
    attn = torch.ones(4, 4)
    attn[1] = 0  # dense row 1 keeps nothing
    y = Softmax(layout, 2)(x.clone(), attn_mask=attn, attn_mask_mode="mul")
    dense = _densify(y, layout, 2)[0, 0]
    assert torch.equal(dense[1], torch.zeros(4, dtype=torch.float64))  # DeepSpeed's kernel gives nan
    torch.testing.assert_close(dense[0], torch.softmax(_densify(x, layout, 2)[0, 0, 0], dim=0))


def test_softmax_gradients_pass_gradcheck():
    layout = _layout(2, 2, 2, seed=5)
    x = _randn(2, int(layout.sum()), 2, 2).requires_grad_()
    rpe = _randn(2, 4, 4, seed=1).requires_grad_()
    kp = _randn(2, 4, seed=2)
    softmax = Softmax(layout, 2)
    assert torch.autograd.gradcheck(lambda x, rpe: softmax(x.clone(), 0.7, rpe, kp), (x, rpe))


def test_sdd_softmax_dsd_is_the_sparse_attention_module():
    """The three ops composed as DeepSpeed's SparseSelfAttention composes them, against ds-ops' fused kernels."""
    config = FixedSparsityConfig(num_heads=2, block=16, num_local_blocks=2, num_global_blocks=1)
    seq, head_dim = 64, 16
    layout = config.make_layout(seq)
    q, k, v = (_randn(1, 2, seq, head_dim, dtype=torch.float32, seed=s) for s in (1, 2, 3))
    scores = MatMul(layout, 16, "sdd", trans_b=True)(q, k)
    probs = Softmax(layout, 16)(scores, scale=head_dim**-0.5)
    out = MatMul(layout, 16, "dsd")(probs, v)
    fused = SparseSelfAttention(config, max_seq_length=seq)(q, k, v, causal=False)
    torch.testing.assert_close(out, fused, rtol=1e-4, atol=1e-5)


def test_bad_arguments_say_what_is_allowed():
    layout = _layout(HEADS, ROWS, COLS)
    nnz = int(layout.sum())
    with pytest.raises(ValueError, match="mode must be one of"):
        MatMul(layout, BLOCK, "ssd")
    with pytest.raises(ValueError, match=r"layout values must be 0 or 1, got \[0, 2\]"):
        MatMul(layout * 2, BLOCK, "sdd")
    with pytest.raises(ValueError, match="block must be a positive integer"):
        Softmax(layout, 0)
    with pytest.raises(ValueError, match=r"layout must be a \[rows, cols\] or \[heads, rows, cols\]"):
        Softmax(torch.ones(4), BLOCK)
    dsd = MatMul(layout, BLOCK, "dsd")
    with pytest.raises(ValueError, match=rf"a is the block-sparse operand .* \[batch, {nnz}, 4, 4\], got \(1, 3, 4, 4\)"):
        dsd(torch.randn(1, 3, 4, 4), torch.randn(1, HEADS, COLS * BLOCK, 2))
    with pytest.raises(ValueError, match=r"b must have 16 rows .* got 12"):
        dsd(torch.randn(1, nnz, 4, 4), torch.randn(1, HEADS, 12, 2))
    with pytest.raises(ValueError, match=r"b has 3 heads .* the layout 2"):
        dsd(torch.randn(1, nnz, 4, 4), torch.randn(1, 3, 16, 2))
    with pytest.raises(ValueError, match="must share one dtype"):
        dsd(torch.randn(1, nnz, 4, 4), torch.randn(1, HEADS, 16, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"op\(b\) must have 16 columns"):
        MatMul(layout, BLOCK, "sdd", trans_b=True)(torch.randn(1, HEADS, 12, 8), torch.randn(1, HEADS, 12, 8))
    softmax = Softmax(layout, BLOCK)
    x = torch.randn(1, nnz, 4, 4)
    with pytest.raises(ValueError, match="attn_mask_mode must be one of"):
        softmax(x, attn_mask_mode="multiply")
    with pytest.raises(ValueError, match="key_padding_mask is a bool tensor but key_padding_mask_mode is 'add'"):
        softmax(x, key_padding_mask=torch.ones(1, 16, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attn_mask must be \[seq_q, seq_k\] = \[12, 16\]"):
        softmax(x, attn_mask=torch.ones(16, 16))
    with pytest.raises(ValueError, match="x is a leaf that requires grad"):
        softmax(x.requires_grad_())
