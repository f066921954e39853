"""Flop formulas of the ops that multiply and accumulate: linear, matmuls, einsum, cosine
similarity, convolutions, attention and recurrent layers.

Every formula has the signature ``(out, args, kwargs) -> (flops, macs)`` and sees the op's result
and its arguments exactly as the caller passed them. Conventions (README, "Flop conventions"):
one MAC is two flops; a bias or ``beta * input`` adds one flop per output element; ``alpha`` or
``beta`` other than 1 costs one more multiply per output element.
"""

from __future__ import annotations

import math
import string

import torch
from torch import Tensor

Result = tuple[int, int]
NOTHING: Result = (0, 0)


def arg(args: tuple, kwargs: dict, index: int, name: str, default=None):
    """The argument at ``index`` (positional) or ``name`` (keyword)."""
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


def first_tensor(out) -> Tensor | None:
    if isinstance(out, Tensor):
        return out
    if isinstance(out, (tuple, list)):
        for item in out:
            if isinstance(item, Tensor):
                return item
    return None


def _scaled_add(n: int, beta, alpha) -> int:
    """Flops of ``beta * input + alpha * product`` on top of the product's own MACs."""
    extra = 0
    if beta != 0:
        extra += n  # the add
        if beta != 1:
            extra += n
    if alpha != 1:
        extra += n
    return extra


def linear(out, args, kwargs) -> Result:
    weight = arg(args, kwargs, 1, "weight")
    bias = arg(args, kwargs, 2, "bias")
    n = out.numel()
    macs = n * weight.shape[-1]
    return 2 * macs + (n if bias is not None else 0), macs


def bilinear(out, args, kwargs) -> Result:
    """``y_o = x1^T W_o x2 + b_o``: ``W_o x2`` (I1*I2 MACs) then the dot with x1 (I1 MACs)."""
    weight = arg(args, kwargs, 2, "weight")
    bias = arg(args, kwargs, 3, "bias")
    n = out.numel()
    in1, in2 = weight.shape[1], weight.shape[2]
    macs = n * (in1 * in2 + in1)
    return 2 * macs + (n if bias is not None else 0), macs


def matmul(out, args, kwargs) -> Result:
    """matmul / mm / bmm / mv / dot and ``@``: every output element is a K-long dot product."""
    first = args[0] if args else kwargs.get("input")
    k = first.shape[-1] if first.dim() > 0 else 1
    macs = out.numel() * k
    return 2 * macs, macs


def rmatmul(out, args, kwargs) -> Result:
    """``other @ tensor`` reached through ``Tensor.__rmatmul__(tensor, other)``."""
    return matmul(out, (args[1], args[0]), {})


def addmm(out, args, kwargs) -> Result:
    """addmm / baddbmm / addmv: ``beta * input + alpha * (m1 @ m2)``."""
    m1 = arg(args, kwargs, 1, "mat1")
    if m1 is None:
        m1 = kwargs.get("batch1", kwargs.get("mat"))
    n = out.numel()
    macs = n * m1.shape[-1]
    return 2 * macs + _scaled_add(n, kwargs.get("beta", 1), kwargs.get("alpha", 1)), macs


def addbmm(out, args, kwargs) -> Result:
    """``beta * input + alpha * sum_b(b1[b] @ b2[b])``: the batch sum is part of the accumulation."""
    b1 = arg(args, kwargs, 1, "batch1")
    b2 = arg(args, kwargs, 2, "batch2")
    macs = b1.numel() * b2.shape[-1]
    return 2 * macs + _scaled_add(out.numel(), kwargs.get("beta", 1), kwargs.get("alpha", 1)), macs


def cosine_similarity(out, args, kwargs) -> Result:
    """``x1 . x2 / (|x1| |x2|)`` along ``dim``: every element of the broadcast inputs is one term of
    one output's dot product (a MAC) and of the two norms (2 flops per element each, as ``norm``);
    the division is a per-output scalar, not counted."""
    x1, x2 = arg(args, kwargs, 0, "x1"), arg(args, kwargs, 1, "x2")
    macs = math.prod(torch.broadcast_shapes(x1.shape, x2.shape))
    return 2 * macs + 2 * 2 * macs, macs


def tensordot(out, args, kwargs) -> Result:
    a = arg(args, kwargs, 0, "a")
    dims = arg(args, kwargs, 2, "dims", 2)
    if isinstance(dims, Tensor):
        dims = dims.tolist()
    if isinstance(dims, int):
        contracted = list(range(a.dim() - dims, a.dim()))
    else:
        first = dims[0]
        contracted = [first] if isinstance(first, int) else list(first)
    k = math.prod(a.shape[d] for d in contracted)
    macs = out.numel() * k
    return 2 * macs, macs


# -- einsum ---------------------------------------------------------------------------------------

def _einsum_operands(args) -> tuple[str, list[Tensor]]:
    if isinstance(args[0], str):
        operands = args[1:]
        if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
            operands = operands[0]
        return args[0], list(operands)
    # sublist format: op, [i, j], op, [j, k], ..., [out]
    letters = string.ascii_letters
    operands, terms, output = [], [], None
    items = list(args)
    if len(items) % 2 == 1:
        output = items.pop()
    for op, sub in zip(items[0::2], items[1::2], strict=True):
        operands.append(op)
        terms.append("".join("..." if s is Ellipsis else letters[s] for s in sub))
    equation = ",".join(terms)
    if output is not None:
        equation += "->" + "".join("..." if s is Ellipsis else letters[s] for s in output)
    return equation, operands


def einsum(out, args, kwargs) -> Result:
    """Pairwise contractions left to right; each costs the product of the sizes of every index of
    the pair (MACs). One operand: a reduction costs one add per input element."""
    equation, operands = _einsum_operands(args)
    equation = equation.replace(" ", "")
    lhs, arrow, rhs = equation.partition("->")
    terms = lhs.split(",")
    spare = iter(c for c in string.ascii_letters if c not in equation)
    ellipsis_letters = ""
    expanded, sizes = [], {}
    for term, operand in zip(terms, operands, strict=True):
        if "..." in term:
            n_ellipsis = operand.dim() - (len(term) - 3)
            while len(ellipsis_letters) < n_ellipsis:
                ellipsis_letters = next(spare) + ellipsis_letters
            term = term.replace("...", ellipsis_letters[len(ellipsis_letters) - n_ellipsis:])
        for letter, size in zip(term, operand.shape, strict=True):
            sizes[letter] = max(sizes.get(letter, 1), size)
        expanded.append(term)
    if arrow:
        rhs = rhs.replace("...", ellipsis_letters)
    else:
        counts = {c: "".join(expanded).count(c) for c in sizes}
        rhs = ellipsis_letters + "".join(sorted(c for c, k in counts.items() if k == 1 and c not in ellipsis_letters))
    if len(expanded) == 1:
        reduced = operands[0].numel() if len(set(rhs)) < len(set(expanded[0])) else 0
        return reduced, 0
    macs = 0
    current = expanded[0]
    for i, term in enumerate(expanded[1:], start=1):
        involved = dict.fromkeys(current + term)
        macs += math.prod(sizes[c] for c in involved)
        needed = set("".join(expanded[i + 1:])) | set(rhs)
        current = "".join(c for c in involved if c in needed)
    return 2 * macs, macs


# -- convolutions ---------------------------------------------------------------------------------

def conv(out, args, kwargs) -> Result:
    """Every output element is a dot product over ``C_in / groups * prod(kernel)`` inputs."""
    weight = arg(args, kwargs, 1, "weight")
    bias = arg(args, kwargs, 2, "bias")
    n = out.numel()
    macs = n * (weight.numel() // weight.shape[0])
    return 2 * macs + (n if bias is not None else 0), macs


def conv_transpose(out, args, kwargs) -> Result:
    """Every input element is scattered into ``C_out / groups * prod(kernel)`` outputs."""
    inp = arg(args, kwargs, 0, "input")
    weight = arg(args, kwargs, 1, "weight")
    bias = arg(args, kwargs, 2, "bias")
    macs = inp.numel() * (weight.numel() // weight.shape[0])
    return 2 * macs + (out.numel() if bias is not None else 0), macs


# -- attention ------------------------------------------------------------------------------------

SOFTMAX_FLOPS = 5  # max, subtract, exp, sum, divide: per element (README)


def scaled_dot_product_attention(out, args, kwargs) -> Result:
    """``softmax(Q K^T * scale + mask) V``, dense: a causal mask is applied, not skipped.

    MACs: L*S*E (scores) + L*S*Ev (weighted values) per batch*head. Per score element: 1 (scale)
    + 5 (softmax) + 1 if a mask or ``is_causal`` + 1 if ``dropout_p > 0``.
    """
    query = arg(args, kwargs, 0, "query")
    key = arg(args, kwargs, 1, "key")
    mask = arg(args, kwargs, 3, "attn_mask")
    dropout_p = arg(args, kwargs, 4, "dropout_p", 0.0)
    is_causal = arg(args, kwargs, 5, "is_causal", False)
    length_q, embed = query.shape[-2], query.shape[-1]
    length_k, embed_v = key.shape[-2], out.shape[-1]
    batch_heads = out.numel() // (length_q * embed_v)
    scores = batch_heads * length_q * length_k
    macs = scores * (embed + embed_v)
    per_score = 1 + SOFTMAX_FLOPS + (1 if (mask is not None or is_causal) else 0) + (1 if dropout_p else 0)
    return 2 * macs + per_score * scores, macs


def multi_head_attention(out, args, kwargs) -> Result:
    """F.multi_head_attention_forward (nn.MultiheadAttention): input projections, attention as in
    :func:`scaled_dot_product_attention` (scores per head, with ``bias_k``/``add_zero_attn`` adding a
    key), the head average of the returned weights (1 per score), output projection."""
    query, key, value = args[0], args[1], args[2]
    num_heads = arg(args, kwargs, 4, "num_heads")
    in_proj_bias = arg(args, kwargs, 6, "in_proj_bias")
    bias_k = arg(args, kwargs, 7, "bias_k")
    add_zero_attn = arg(args, kwargs, 9, "add_zero_attn", False)
    dropout_p = arg(args, kwargs, 10, "dropout_p", 0.0)
    out_proj_bias = arg(args, kwargs, 12, "out_proj_bias")
    training = arg(args, kwargs, 13, "training", True)
    key_padding_mask = arg(args, kwargs, 14, "key_padding_mask")
    need_weights = arg(args, kwargs, 15, "need_weights", True)
    attn_mask = arg(args, kwargs, 16, "attn_mask")
    static_k = arg(args, kwargs, 21, "static_k")
    static_v = arg(args, kwargs, 22, "static_v")
    average = arg(args, kwargs, 23, "average_attn_weights", True)
    is_causal = arg(args, kwargs, 24, "is_causal", False)

    embed = query.shape[-1]
    length_q = query.shape[0]
    tokens_q = query.numel() // embed
    batch = tokens_q // length_q
    length_k = key.shape[0]
    tokens_k = key.numel() // key.shape[-1]
    macs = tokens_q * embed * embed  # q projection
    flops = 0
    if static_k is None:
        macs += tokens_k * embed * key.shape[-1]
    if static_v is None:
        macs += tokens_k * embed * value.shape[-1]
    if in_proj_bias is not None:
        flops += tokens_q * embed + 2 * tokens_k * embed
    if static_k is not None:
        length_k = static_k.shape[1]
    length_k += (1 if bias_k is not None else 0) + (1 if add_zero_attn else 0)
    scores = batch * num_heads * length_q * length_k
    macs += 2 * batch * length_q * length_k * embed  # Q K^T and weights @ V over all heads
    masked = attn_mask is not None or key_padding_mask is not None or is_causal
    per_score = 1 + SOFTMAX_FLOPS + (1 if masked else 0) + (1 if (dropout_p and training) else 0)
    flops += per_score * scores
    if need_weights and average:
        flops += scores
    macs += tokens_q * embed * embed  # output projection
    if out_proj_bias is not None:
        flops += tokens_q * embed
    return 2 * macs + flops, macs


# -- recurrent layers -----------------------------------------------------------------------------

# Elementwise flops per hidden unit and step on top of the projections and their sum (README):
# RNN: the nonlinearity; LSTM: 3 sigmoids + tanh, c' = f*c + i*g (3), h' = o*tanh(c') (2);
# GRU: 2 sigmoids, r*(W_hn h + b_hn), tanh, h' = n + z*(h - n) (3).
_CELL_FLOPS = {"rnn": 1, "lstm": 9, "gru": 7}


def _step_cost(kind: str, w_ih: Tensor, w_hh: Tensor, has_bias: bool, w_hr: Tensor | None) -> Result:
    """(flops, macs) of one layer-direction for one sample and one time step."""
    gates, inputs = w_ih.shape
    hidden = gates // {"rnn": 1, "lstm": 4, "gru": 3}[kind]
    macs = gates * inputs + gates * w_hh.shape[1]
    if w_hr is not None:
        macs += w_hr.numel()
    flops = 2 * macs + gates + _CELL_FLOPS[kind] * hidden  # + gates: summing the two projections
    if has_bias:
        flops += 2 * gates
    return flops, macs


def _rnn(kind: str, out, args, kwargs) -> Result:
    """torch.lstm/gru/rnn_tanh/rnn_relu, padded (input, hx, params, has_biases, num_layers, ...)
    or packed (data, batch_sizes, hx, params, has_biases, num_layers, ...)."""
    data = args[0]
    packed = isinstance(args[1], Tensor) and not args[1].is_floating_point()
    params, has_biases, num_layers, _dropout, _train, bidirectional = args[3 if packed else 2:9 if packed else 8]
    directions = 2 if bidirectional else 1
    per_layer = len(params) // (num_layers * directions)
    has_proj = per_layer == (5 if has_biases else 3)
    steps = data.shape[0] if packed else data.numel() // data.shape[-1]
    flops = macs = 0
    for index in range(num_layers * directions):
        chunk = params[index * per_layer:(index + 1) * per_layer]
        w_hr = chunk[-1] if has_proj else None
        f, m = _step_cost(kind, chunk[0], chunk[1], has_biases, w_hr)
        flops += f * steps
        macs += m * steps
    return flops, macs


def _cell(kind: str, out, args, kwargs) -> Result:
    """torch.lstm_cell/gru_cell/rnn_*_cell(input, hx, w_ih, w_hh, b_ih=None, b_hh=None)."""
    inp, w_ih, w_hh = args[0], arg(args, kwargs, 2, "w_ih"), arg(args, kwargs, 3, "w_hh")
    has_bias = arg(args, kwargs, 4, "b_ih") is not None
    steps = inp.numel() // inp.shape[-1]
    flops, macs = _step_cost(kind, w_ih, w_hh, has_bias, None)
    return flops * steps, macs * steps


def lstm(out, args, kwargs) -> Result:
    return _rnn("lstm", out, args, kwargs)


def gru(out, args, kwargs) -> Result:
    return _rnn("gru", out, args, kwargs)


def rnn(out, args, kwargs) -> Result:
    return _rnn("rnn", out, args, kwargs)


def lstm_cell(out, args, kwargs) -> Result:
    return _cell("lstm", out, args, kwargs)


def gru_cell(out, args, kwargs) -> Result:
    return _cell("gru", out, args, kwargs)


def rnn_cell(out, args, kwargs) -> Result:
    return _cell("rnn", out, args, kwargs)
