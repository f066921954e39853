"""Op by op: the flops and MACs of one call, computed by hand from the README's conventions.

Every op is called from inside a custom module (``Lambda``), so these tests also show that
functional and tensor ops need no per-module counter.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _models import count, count_fn
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.utils.rnn import pack_padded_sequence
from torch.utils.flop_counter import FlopCounterMode

r = torch.randn


def x35():
    return r(3, 5)


# (id, function, inputs, expected flops, expected MACs)
CASES = [
    # -- contractions: 2 flops per MAC, + 1 per output element for a bias/beta*input
    ("linear", F.linear, (r(4, 8), r(16, 8), r(16)), 2 * 4 * 8 * 16 + 4 * 16, 4 * 8 * 16),
    ("linear-3d-nobias", F.linear, (r(2, 3, 8), r(16, 8)), 2 * 6 * 8 * 16, 6 * 8 * 16),
    ("matmul-broadcast", torch.matmul, (r(2, 3, 4, 5), r(5, 6)), 2 * 144 * 5, 144 * 5),
    ("operator-@", lambda a, b: a @ b, (r(3, 4), r(4, 5)), 120, 60),
    ("mm", torch.mm, (r(3, 4), r(4, 5)), 120, 60),
    ("bmm", torch.bmm, (r(2, 3, 4), r(2, 4, 5)), 240, 120),
    ("addmm", torch.addmm, (r(5), r(3, 4), r(4, 5)), 120 + 15, 60),
    ("addmm-beta-alpha", lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0),
     (r(5), r(3, 4), r(4, 5)), 120 + 15 + 15 + 15, 60),
    ("addmm-beta0", lambda c, a, b: torch.addmm(c, a, b, beta=0), (r(5), r(3, 4), r(4, 5)), 120, 60),
    ("baddbmm", torch.baddbmm, (r(2, 3, 5), r(2, 3, 4), r(2, 4, 5)), 240 + 30, 120),
    ("mv", torch.mv, (r(3, 4), r(4)), 24, 12),
    ("dot", torch.dot, (r(7), r(7)), 14, 7),
    ("tensordot", lambda a, b: torch.tensordot(a, b, dims=2), (r(2, 3, 4), r(3, 4, 5)), 240, 120),
    ("einsum-bmm", lambda a, b: torch.einsum("bij,bjk->bik", a, b), (r(2, 3, 4), r(2, 4, 5)), 240, 120),
    ("einsum-chain", lambda a, b, c: torch.einsum("ij,jk,kl->il", a, b, c),
     (r(2, 3), r(3, 4), r(4, 5)), 2 * (2 * 3 * 4 + 2 * 4 * 5), 2 * 3 * 4 + 2 * 4 * 5),
    ("einsum-ellipsis", lambda a, b: torch.einsum("...ij,...jk->...ik", a, b), (r(2, 3, 4), r(2, 4, 5)), 240, 120),
    ("einsum-implicit", lambda a, b: torch.einsum("ij,jk", a, b), (r(3, 4), r(4, 5)), 120, 60),
    ("einsum-sum", lambda a: torch.einsum("ij->i", a), (r(3, 4),), 12, 0),
    ("einsum-transpose", lambda a: torch.einsum("ij->ji", a), (r(3, 4),), 0, 0),
    # -- outer products: a broadcast multiply, 1 per output element (no accumulation, no MACs);
    # addr adds beta * input as addmm does
    ("outer", torch.outer, (r(3), r(5)), 15, 0),
    ("ger-method", lambda a, b: a.ger(b), (r(3), r(5)), 15, 0),
    ("addr", torch.addr, (x35(), r(3), r(5)), 15 + 15, 0),
    ("addr-beta-alpha", lambda c, a, b: torch.addr(c, a, b, beta=0.5, alpha=2.0), (x35(), r(3), r(5)),
     15 + 15 + 15 + 15, 0),
    ("addr-beta0", lambda c, a, b: torch.addr(c, a, b, beta=0), (x35(), r(3), r(5)), 15, 0),
    ("addr_-inplace", lambda c, a, b: c.clone().addr_(a, b), (x35(), r(3), r(5)), 30, 0),
    # -- distances: cdist, per output and coordinate: subtract, |.|^p, sum (any p, any kernel);
    # cosine_similarity, per output: the D-long dot (MACs) + two norms at 2 per element
    ("cdist", torch.cdist, (r(2, 4, 3), r(2, 6, 3)), 3 * 48 * 3, 0),
    ("cdist-p1", lambda a, b: torch.cdist(a, b, p=1), (r(4, 3), r(6, 3)), 3 * 24 * 3, 0),
    ("cdist-mm-kernel", torch.cdist, (r(30, 3), r(40, 3)), 3 * 1200 * 3, 0),  # > 25 rows: torch uses mm
    ("cosine_similarity", F.cosine_similarity, (r(4, 8), r(4, 8)), 2 * 32 + 4 * 32, 32),
    ("cosine_similarity-broadcast", lambda a, b: F.cosine_similarity(a, b, dim=-1), (r(2, 3, 8), r(8)),
     2 * 48 + 4 * 48, 48),
    ("bilinear", F.bilinear, (r(4, 3), r(4, 5), r(6, 3, 5), r(6)), 2 * 24 * (15 + 3) + 24, 24 * (15 + 3)),
    ("conv1d-stride", lambda x, w: F.conv1d(x, w, stride=2), (r(2, 3, 10), r(5, 3, 3)), 2 * 40 * 9, 40 * 9),
    ("conv2d-bias", F.conv2d, (r(2, 3, 8, 8), r(4, 3, 3, 3), r(4)), 2 * 288 * 27 + 288, 288 * 27),
    ("conv2d-groups", lambda x, w: F.conv2d(x, w, padding=1, groups=2), (r(1, 4, 5, 5), r(6, 2, 3, 3)),
     2 * 150 * 18, 150 * 18),
    ("conv3d", F.conv3d, (r(1, 2, 4, 4, 4), r(3, 2, 2, 2, 2)), 2 * 81 * 16, 81 * 16),
    # transposed: every input element meets C_out/groups * k*k weights; out (2, 6, 11, 11)
    ("conv_transpose2d", lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, groups=2),
     (r(2, 4, 5, 5), r(4, 3, 3, 3), r(6)), 2 * 200 * 27 + 2 * 6 * 11 * 11, 200 * 27),
    ("conv_transpose1d", F.conv_transpose1d, (r(1, 2, 6), r(2, 3, 4)), 2 * 12 * 12, 12 * 12),
    # -- attention: 480 scores of 8-dim heads; per score 1 (scale) + 5 (softmax) [+1 mask] [+1 dropout]
    ("sdpa", F.scaled_dot_product_attention, (r(2, 4, 6, 8), r(2, 4, 10, 8), r(2, 4, 10, 8)),
     2 * 480 * 16 + 6 * 480, 480 * 16),
    ("sdpa-causal", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
     (r(2, 4, 10, 8), r(2, 4, 10, 8), r(2, 4, 10, 8)), 2 * 800 * 16 + 7 * 800, 800 * 16),
    ("sdpa-mask", lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
     (r(2, 4, 6, 8), r(2, 4, 10, 8), r(2, 4, 10, 8), torch.ones(6, 10, dtype=torch.bool)),
     2 * 480 * 16 + 7 * 480, 480 * 16),
    ("sdpa-value-dim", F.scaled_dot_product_attention, (r(2, 4, 6, 8), r(2, 4, 10, 8), r(2, 4, 10, 3)),
     2 * 480 * 11 + 6 * 480, 480 * 11),
    ("sdpa-gqa", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
     (r(2, 4, 6, 8), r(2, 2, 10, 8), r(2, 2, 10, 8)), 2 * 480 * 16 + 6 * 480, 480 * 16),
    # -- softmax and normalisation
    ("softmax", lambda x: F.softmax(x, dim=-1), (r(3, 7),), 5 * 21, 0),
    ("log_softmax-method", lambda x: x.log_softmax(-1), (r(3, 7),), 5 * 21, 0),
    ("layer_norm", lambda x, w, b: F.layer_norm(x, (8,), w, b), (r(2, 5, 8), r(8), r(8)), 7 * 80, 0),
    ("layer_norm-no-affine", lambda x: F.layer_norm(x, (8,)), (r(2, 5, 8),), 5 * 80, 0),
    ("rms_norm", lambda x, w: F.rms_norm(x, (8,), w), (r(2, 5, 8), r(8)), 4 * 80, 0),
    ("group_norm", lambda x, w, b: F.group_norm(x, 3, w, b), (r(2, 6, 4, 4), r(6), r(6)), 7 * 192, 0),
    ("batch_norm-eval", lambda x, m, v, w, b: F.batch_norm(x, m, v, w, b, training=False),
     (r(2, 3, 4, 4), torch.zeros(3), torch.ones(3), r(3), r(3)), 4 * 96, 0),
    ("batch_norm-train", lambda x, m, v, w, b: F.batch_norm(x, m, v, w, b, training=True),
     (r(2, 3, 4, 4), torch.zeros(3), torch.ones(3), r(3), r(3)), 7 * 96, 0),
    ("instance_norm", F.instance_norm, (r(2, 3, 4, 4),), 5 * 96, 0),
    ("normalize", F.normalize, (x35(),), 3 * 15, 0),
    # -- activations: 1 per element (glu: sigmoid and product per output element)
    *[(f"act-{f.__name__}", f, (x35(),), 15, 0) for f in (
        F.relu, F.gelu, F.silu, torch.sigmoid, torch.tanh, F.leaky_relu, F.elu, F.hardswish,
        F.softplus, F.mish, F.relu6, F.hardtanh, torch.exp, torch.rsqrt, torch.erf)],
    ("glu", F.glu, (r(3, 6),), 2 * 9, 0),
    # -- elementwise arithmetic: 1 per result element, integer and boolean results free
    ("add", lambda a, b: a + b, (x35(), x35()), 15, 0),
    ("add-broadcast", lambda a, b: a + b, (r(3, 1), r(1, 5)), 15, 0),
    ("add-alpha", lambda a, b: torch.add(a, b, alpha=2), (x35(), x35()), 30, 0),
    ("mul-scalar", lambda a: a * 2, (x35(),), 15, 0),
    ("rmul-scalar", lambda a: 2 * a, (x35(),), 15, 0),
    ("rsub", lambda a: 1 - a, (x35(),), 15, 0),
    ("div", lambda a, b: a / b, (x35(), x35()), 15, 0),
    ("pow", lambda a: a**2, (x35(),), 15, 0),
    ("neg", lambda a: -a, (x35(),), 15, 0),
    ("inplace-add", lambda a, b: a.clone().add_(b), (x35(), x35()), 15, 0),
    ("iadd", lambda a, b: a.clone().__iadd__(b), (x35(), x35()), 15, 0),
    ("addcmul", lambda a, b, c: torch.addcmul(a, b, c, value=0.5), (x35(), x35(), x35()), 45, 0),
    ("lerp", torch.lerp, (x35(), x35(), x35()), 45, 0),
    ("integer-arith", lambda a: torch.arange(10) * 2 + a.shape[0], (x35(),), 0, 0),
    ("comparison-where", lambda a: torch.where(a > 0, a, a.new_zeros(())), (x35(),), 0, 0),
    # -- reductions: per input element
    ("sum", lambda a: a.sum(), (x35(),), 15, 0),
    ("mean", lambda a: a.mean(-1), (x35(),), 15, 0),
    ("var", torch.var, (x35(),), 60, 0),
    ("logsumexp", lambda a: torch.logsumexp(a, -1), (x35(),), 60, 0),
    ("norm", lambda a: a.norm(), (x35(),), 30, 0),
    ("max-reduce", torch.max, (x35(),), 15, 0),
    ("max-elementwise", torch.max, (x35(), x35()), 15, 0),
    ("cumsum", lambda a: torch.cumsum(a, 0), (x35(),), 15, 0),
    # -- pooling: one flop per window element of every output; adaptive windows exact
    ("max_pool2d", lambda x: F.max_pool2d(x, 2), (r(2, 3, 8, 8),), 96 * 4, 0),
    ("max_pool2d-overlap", lambda x: F.max_pool2d(x, 3, stride=1), (r(2, 3, 8, 8),), 216 * 9, 0),
    ("max_pool2d-indices", lambda x: F.max_pool2d(x, 2, return_indices=True), (r(2, 3, 8, 8),), 96 * 4, 0),
    ("avg_pool1d", lambda x: F.avg_pool1d(x, 3), (r(2, 3, 10),), 18 * 3, 0),
    ("avg_pool2d", lambda x: F.avg_pool2d(x, (2, 3)), (r(1, 2, 6, 6),), 12 * 6, 0),
    # 5 -> 2 rows: windows [0,3) [2,5) = 6 rows; 7 -> 3 cols: [0,3) [2,5) [4,7) = 9 cols
    ("adaptive_avg_pool2d-uneven", lambda x: F.adaptive_avg_pool2d(x, (2, 3)), (r(1, 2, 5, 7),), 2 * 6 * 9, 0),
    ("adaptive_max_pool1d", lambda x: F.adaptive_max_pool1d(x, 1), (r(2, 3, 10),), 60, 0),
    # -- interpolation: nearest copies; a weighted sum of t taps is 2t - 1 flops per output
    ("upsample-nearest", lambda x: F.interpolate(x, scale_factor=2), (r(1, 2, 4, 4),), 0, 0),
    ("upsample-bilinear", lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), (r(1, 2, 4, 4),), 128 * 7, 0),
    ("upsample-bicubic", lambda x: F.interpolate(x, scale_factor=2, mode="bicubic"), (r(1, 2, 4, 4),), 128 * 31, 0),
    ("upsample-linear", lambda x: F.interpolate(x, size=10, mode="linear"), (r(1, 2, 5),), 20 * 3, 0),
    ("downsample-area", lambda x: F.interpolate(x, size=(2, 2), mode="area"), (r(1, 2, 4, 4),), 32, 0),
    # -- embeddings, dropout, losses
    ("embedding", F.embedding, (torch.tensor([[1, 2], [3, 4]]), r(10, 3)), 0, 0),
    ("embedding_bag-sum", lambda i, w: F.embedding_bag(i, w, mode="sum"), (torch.zeros(2, 4, dtype=torch.long), r(10, 3)), 24, 0),
    ("embedding_bag-mean", lambda i, w: F.embedding_bag(i, w), (torch.zeros(2, 4, dtype=torch.long), r(10, 3)), 24 + 6, 0),
    ("dropout-train", lambda x: F.dropout(x, 0.5, training=True), (x35(),), 15, 0),
    ("dropout-eval", lambda x: F.dropout(x, 0.5, training=False), (x35(),), 0, 0),
    ("cross_entropy", F.cross_entropy, (r(4, 5), torch.tensor([0, 1, 2, 3])), 5 * 20 + 4, 0),
    ("mse_loss", F.mse_loss, (x35(), x35()), 2 * 15 + 15, 0),
    ("l1_loss-none", lambda a, b: F.l1_loss(a, b, reduction="none"), (x35(), x35()), 2 * 15, 0),
]


@pytest.mark.parametrize(("fn", "inputs", "flops", "macs"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_op(fn, inputs, flops, macs):
    assert count_fn(fn, *inputs) == (flops, macs)


# -- recurrent layers: per sample and step, G = gates * hidden:
# MACs G*in + G*h_in; flops 2*MACs + G (sum of projections) + 2G (biases) + per-unit elementwise
# (LSTM 9, GRU 7, RNN 1) * hidden.
def rnn_step(gates, unit_flops, d_in, hidden, h_in=None, bias=True):
    g = gates * hidden
    macs = g * d_in + g * (hidden if h_in is None else h_in)
    return 2 * macs + g + (2 * g if bias else 0) + unit_flops * hidden, macs


def scaled(pair, k):
    return pair[0] * k, pair[1] * k


RNN_CASES = [
    ("lstm_cell", nn.LSTMCell(3, 5), (r(2, 3),), scaled(rnn_step(4, 9, 3, 5), 2)),
    ("gru_cell", nn.GRUCell(3, 5), (r(2, 3),), scaled(rnn_step(3, 7, 3, 5), 2)),
    ("rnn_cell", nn.RNNCell(3, 5), (r(2, 3),), scaled(rnn_step(1, 1, 3, 5), 2)),
    ("rnn_cell-unbatched", nn.RNNCell(3, 5), (r(3),), rnn_step(1, 1, 3, 5)),
    ("gru-seq-first", nn.GRU(3, 5), (r(6, 2, 3),), scaled(rnn_step(3, 7, 3, 5), 12)),
    ("rnn-relu-nobias", nn.RNN(3, 5, nonlinearity="relu", bias=False, batch_first=True), (r(2, 4, 3),),
     scaled(rnn_step(1, 1, 3, 5, bias=False), 8)),
    # 2 layers x 2 directions; layer 1 sees both directions' outputs (10 inputs)
    ("lstm-bidirectional-2-layers", nn.LSTM(3, 5, num_layers=2, bidirectional=True, batch_first=True), (r(2, 7, 3),),
     tuple(14 * 2 * (a + b) for a, b in zip(rnn_step(4, 9, 3, 5), rnn_step(4, 9, 10, 5), strict=True))),
]


@pytest.mark.parametrize(("module", "inputs", "expected"), [c[1:] for c in RNN_CASES], ids=[c[0] for c in RNN_CASES])
def test_recurrent(module, inputs, expected):
    assert count(module, *inputs) == expected


@pytest.mark.filterwarnings("ignore:LSTM with projections")
def test_lstm_projection_unbatched():
    # W_hh is (4h, proj); the projection W_hr (proj, h) adds proj*h MACs per step
    flops, macs = rnn_step(4, 9, 3, 5, h_in=2)
    assert count(nn.LSTM(3, 5, proj_size=2), r(4, 3)) == (4 * (flops + 2 * 2 * 5), 4 * (macs + 2 * 5))


def test_packed_sequence_counts_only_real_steps():
    x = r(3, 4, 3)
    packed = pack_padded_sequence(x, torch.tensor([4, 2, 1]), batch_first=True)
    assert count(nn.LSTM(3, 5, batch_first=True), packed) == scaled(rnn_step(4, 9, 3, 5), 4 + 2 + 1)


def test_multihead_attention():
    # self-attention, 10 tokens of width 8, 2 heads, 5x5 scores per head and sample
    model = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = r(2, 5, 8)
    projections = 4 * 10 * 8 * 8
    scores = 2 * 2 * 5 * 5
    macs = projections + 2 * 2 * 5 * 5 * 8
    flops = 2 * macs + 3 * 10 * 8 + 10 * 8 + 6 * scores + scores  # in/out biases, scale+softmax, head average
    assert count(model, x, x, x) == (flops, macs)
    assert count(model, x, x, x, need_weights=False) == (flops - scores, macs)


# -- independent reference: torch's aten-level FlopCounterMode (2 flops per MAC of mm/bmm/conv/attention)
REFERENCE = [c for c in CASES if c[4] and not c[0].startswith(
    ("einsum-chain", "bilinear", "tensordot", "dot", "mv", "cosine_similarity"))]


@pytest.mark.parametrize(("fn", "inputs", "macs"), [(c[1], c[2], c[4]) for c in REFERENCE], ids=[c[0] for c in REFERENCE])
def test_macs_match_torch_flop_counter(fn, inputs, macs):
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        fn(*inputs)
    assert counter.get_total_flops() == 2 * macs


def test_multihead_attention_matches_torch_flop_counter():
    model = nn.MultiheadAttention(8, 2, kdim=4, vdim=6, batch_first=True)
    q, k, v = r(2, 5, 8), r(2, 7, 4), r(2, 7, 6)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(q, k, v)  # grad enabled: the decomposed path, which torch's counter sees
    assert counter.get_total_flops() == 2 * count(model, q, k, v)[1]


def test_transformer_encoder_layer_matches_torch_flop_counter():
    model = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    x = r(2, 5, 8)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x)
    assert counter.get_total_flops() == 2 * count(model.eval(), x)[1]


def test_custom_autograd_function_is_seen():
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a @ a

        @staticmethod
        def backward(ctx, grad):
            return grad

    assert count_fn(Square.apply, r(4, 4)) == (128, 64)
