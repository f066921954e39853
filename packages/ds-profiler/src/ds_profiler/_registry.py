"""Which flop formula counts which callable.

The counting mode (``_mode``) sees the callables a model calls through ``__torch_function__``:
``torch.nn.functional.linear``, ``torch.Tensor.add``, ``torch.Tensor.__rsub__``, ``torch.lstm``, ...
This table maps every spelling of an op (function, method, in-place method, operator) to its
formula. Built once at import; an attribute missing from this torch version is skipped.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import _contractions as c
from . import _pointwise as p

Counter = Callable[[object, tuple, dict], tuple[int, int]]

_NAMESPACES = (torch, F, torch._C._nn, torch.special, torch.linalg)


def _spellings(name: str, *, tensor_methods: bool = True, inplace: bool = True) -> list:
    """Every object named ``name`` in the functional namespaces, and as a (in-place) Tensor method."""
    found = [getattr(ns, name, None) for ns in _NAMESPACES]
    if tensor_methods:
        found.append(getattr(torch.Tensor, name, None))
        if inplace:
            found.append(getattr(torch.Tensor, name + "_", None))
    if inplace:
        found.extend(getattr(ns, name + "_", None) for ns in (torch, F))
    return [f for f in found if f is not None]


def _dunders(*names: str) -> list:
    return [getattr(torch.Tensor, n) for n in names if hasattr(torch.Tensor, n)]


# Elementwise ops and activations: 1 flop per element of a floating-point result.
_ONE_FLOP = [
    # arithmetic
    "mul", "multiply", "div", "divide", "true_divide", "floor_divide", "remainder", "fmod",
    "pow", "float_power", "neg", "negative", "reciprocal", "square", "abs", "absolute",
    "maximum", "minimum", "fmax", "fmin", "clamp", "clip", "clamp_min", "clamp_max", "hypot",
    "copysign", "xlogy",
    # transcendental functions: one flop each
    "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "sin", "cos", "tan",
    "asin", "acos", "atan", "atan2", "arctan2", "sinh", "cosh", "erf", "erfc", "erfinv", "expit",
    # activations: one elementwise kernel each
    "relu", "relu6", "elu", "selu", "celu", "leaky_relu", "prelu", "rrelu", "gelu", "silu", "mish",
    "hardswish", "hardsigmoid", "hardtanh", "hardshrink", "softshrink", "tanhshrink", "softplus",
    "softsign", "logsigmoid", "threshold", "sigmoid", "tanh",
]

_REDUCTIONS_ONE = ["sum", "nansum", "mean", "nanmean", "prod", "amax", "amin", "cumsum", "cumprod"]
_REDUCTIONS = {"norm": 2, "vector_norm": 2, "logsumexp": 4, "var": 4, "std": 4, "var_mean": 4, "std_mean": 4}


def _build() -> dict:
    table: dict = {}

    def put(objects, counter: Counter) -> None:
        for obj in objects:
            if obj is not None:
                table[obj] = counter

    # contractions
    put(_spellings("linear", inplace=False), c.linear)
    put(_spellings("bilinear", inplace=False), c.bilinear)
    for name in ("matmul", "mm", "bmm", "mv", "dot", "vdot", "inner"):
        put(_spellings(name, inplace=False), c.matmul)
    put(_dunders("__matmul__"), c.matmul)
    put(_dunders("__rmatmul__"), c.rmatmul)
    for name in ("addmm", "baddbmm", "addmv"):
        put(_spellings(name), c.addmm)
    put(_spellings("addbmm"), c.addbmm)
    put(_spellings("cosine_similarity", tensor_methods=False, inplace=False), c.cosine_similarity)
    put([torch.einsum, getattr(torch.functional, "einsum", None)], c.einsum)
    put([torch.tensordot, getattr(torch.functional, "tensordot", None)], c.tensordot)
    for d in (1, 2, 3):
        put(_spellings(f"conv{d}d", tensor_methods=False, inplace=False), c.conv)
        put(_spellings(f"conv_transpose{d}d", tensor_methods=False, inplace=False), c.conv_transpose)
    put(_spellings("scaled_dot_product_attention", tensor_methods=False, inplace=False),
        c.scaled_dot_product_attention)
    put([F.multi_head_attention_forward], c.multi_head_attention)
    put([torch.lstm], c.lstm)
    put([torch.gru], c.gru)
    put([torch.rnn_tanh, torch.rnn_relu], c.rnn)
    put([torch.lstm_cell], c.lstm_cell)
    put([torch.gru_cell], c.gru_cell)
    put([torch.rnn_tanh_cell, torch.rnn_relu_cell], c.rnn_cell)

    # elementwise
    one = p.per_element(1)
    for name in _ONE_FLOP:
        put(_spellings(name), one)
    put(_dunders("__mul__", "__rmul__", "__imul__", "__truediv__", "__rtruediv__", "__itruediv__",
                 "__div__", "__rdiv__", "__idiv__", "__floordiv__", "__rfloordiv__", "__ifloordiv__",
                 "__mod__", "__rmod__", "__imod__", "__pow__", "__rpow__", "__ipow__", "__neg__", "__abs__"), one)
    for name in ("add", "sub", "subtract", "rsub"):
        put(_spellings(name), p.add_sub)
    put(_dunders("__add__", "__radd__", "__iadd__", "__sub__", "__rsub__", "__isub__"), p.add_sub)
    put(_spellings("addcmul") + _spellings("addcdiv"), p.addcmul)
    put(_spellings("outer", inplace=False) + _spellings("ger", inplace=False), p.outer)
    put(_spellings("addr"), p.addr)
    put(_spellings("cdist", tensor_methods=False, inplace=False), p.cdist)
    put(_spellings("lerp"), p.per_element(3))
    put(_spellings("glu", inplace=False), p.per_element(2))
    put(_spellings("max", inplace=False) + _spellings("min", inplace=False), p.minmax)
    for name in _REDUCTIONS_ONE:
        put(_spellings(name, inplace=False), p.reduction(1))
    for name, cost in _REDUCTIONS.items():
        put(_spellings(name, inplace=False), p.reduction(cost))
    for name in ("softmax", "log_softmax", "softmin"):
        put(_spellings(name, inplace=False), p.softmax)

    # normalisation
    put([F.layer_norm, torch.layer_norm], p.layer_norm)
    put([getattr(F, "rms_norm", None), getattr(torch, "rms_norm", None)], p.rms_norm)
    put([F.group_norm, torch.group_norm], p.group_norm)
    put([F.batch_norm], p.batch_norm_functional)
    put([torch.batch_norm], p.batch_norm_torch)
    put([F.instance_norm], p.instance_norm_functional)
    put([torch.instance_norm], p.instance_norm_torch)
    put([F.normalize], p.normalize)

    # pooling, interpolation
    for d in (1, 2, 3):
        pool = p.pool(d)
        put(_spellings(f"max_pool{d}d", tensor_methods=False, inplace=False), pool)
        put(_spellings(f"avg_pool{d}d", tensor_methods=False, inplace=False), pool)
        put([getattr(F, f"max_pool{d}d_with_indices", None), getattr(F, f"_max_pool{d}d", None)], pool)
        adaptive = p.adaptive_pool(d)
        put(_spellings(f"adaptive_avg_pool{d}d", tensor_methods=False, inplace=False), adaptive)
        put(_spellings(f"adaptive_max_pool{d}d", tensor_methods=False, inplace=False), adaptive)
        put([getattr(F, f"adaptive_max_pool{d}d_with_indices", None),
             getattr(F, f"_adaptive_max_pool{d}d", None)], adaptive)
    put([F.interpolate], p.interpolate)

    # embeddings, dropout, losses
    put([F.embedding, torch.embedding], p.zero)
    put([F.embedding_bag], p.embedding_bag)
    put([F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, torch.dropout, torch.feature_dropout], p.dropout(2))
    put([F.alpha_dropout, F.feature_alpha_dropout], p.dropout(2, training_default=False))
    put([F.cross_entropy], p.cross_entropy)
    put([F.nll_loss], p.nll_loss)
    put([F.mse_loss, F.l1_loss], p.pointwise_loss)
    return table


COUNTERS: dict = _build()
