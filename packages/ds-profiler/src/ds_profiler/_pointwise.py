"""Flop formulas of the ops that do not multiply-accumulate: elementwise arithmetic, activations,
outer products, cdist, softmax, normalisations, reductions, pooling, interpolation, embeddings,
dropout and losses.

Same signature as in ``_contractions``: ``(out, args, kwargs) -> (flops, macs)``; MACs are 0 here.
Only floating-point results cost flops: integer index arithmetic and boolean masks are free.
The per-element costs are the README's table ("Flop conventions").
"""

from __future__ import annotations

import math

from torch import Tensor

from ._contractions import SOFTMAX_FLOPS, Result, _scaled_add, arg, first_tensor

NOTHING: Result = (0, 0)

LAYER_NORM_FLOPS = 5  # mean, subtract, square, sum (variance), multiply by 1/std
RMS_NORM_FLOPS = 3  # square, sum (mean), multiply by 1/rms
NORMALIZE_FROM_STATS_FLOPS = 2  # subtract running mean, multiply by 1/std (eval batch/instance norm)


def _floating(t) -> bool:
    return isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex())


def per_element(cost: int):
    """``cost`` flops per element of a floating-point result."""

    def count(out, args, kwargs) -> Result:
        t = first_tensor(out)
        if t is None or not _floating(t):
            return NOTHING
        return cost * t.numel(), 0

    count.__name__ = f"per_element_{cost}"
    return count


def add_sub(out, args, kwargs) -> Result:
    """add/sub/rsub: 1 flop per element, 1 more when ``alpha`` scales the second operand."""
    if not _floating(out):
        return NOTHING
    return (2 if kwargs.get("alpha", 1) != 1 else 1) * out.numel(), 0


def addcmul(out, args, kwargs) -> Result:
    """addcmul/addcdiv: ``input + value * t1 op t2``: 2 flops per element, 3 when value != 1."""
    if not _floating(out):
        return NOTHING
    return (3 if arg(args, kwargs, 3, "value", 1) != 1 else 2) * out.numel(), 0


def outer(out, args, kwargs) -> Result:
    """outer/ger: ``v1[i] * v2[j]``, a broadcast multiply: 1 flop per output element, no MACs."""
    if not _floating(out):
        return NOTHING
    return out.numel(), 0


def addr(out, args, kwargs) -> Result:
    """addr: ``beta * input + alpha * outer(vec1, vec2)``: the outer product, then as addmm's add."""
    if not _floating(out):
        return NOTHING
    n = out.numel()
    return n + _scaled_add(n, kwargs.get("beta", 1), kwargs.get("alpha", 1)), 0


CDIST_FLOPS = 3  # per output and coordinate: subtract, |.|^p, sum (the root is a per-output scalar)


def cdist(out, args, kwargs) -> Result:
    """cdist(x1 (.., P, M), x2 (.., R, M)): every output is a distance over M coordinates, counted
    from its definition whatever the kernel (torch may use a matmul for p=2)."""
    x1 = arg(args, kwargs, 0, "x1")
    if not _floating(out):
        return NOTHING
    return CDIST_FLOPS * out.numel() * x1.shape[-1], 0


def minmax(out, args, kwargs) -> Result:
    """torch.max/min: elementwise with a second tensor, else a reduction over the input."""
    other = arg(args, kwargs, 1, "other")
    if isinstance(other, Tensor):
        return per_element(1)(out, args, kwargs)
    return reduction(1)(out, args, kwargs)


def reduction(cost: int):
    """``cost`` flops per element of the (floating-point) input."""

    def count(out, args, kwargs) -> Result:
        inp = arg(args, kwargs, 0, "input")
        if not _floating(inp):
            return NOTHING
        return cost * inp.numel(), 0

    count.__name__ = f"reduction_{cost}"
    return count


def softmax(out, args, kwargs) -> Result:
    return reduction(SOFTMAX_FLOPS)(out, args, kwargs)


def _affine(inp: Tensor, weight, bias) -> int:
    return inp.numel() * ((weight is not None) + (bias is not None))


def layer_norm(out, args, kwargs) -> Result:
    """F.layer_norm/torch.layer_norm(input, normalized_shape, weight, bias, eps)."""
    inp = arg(args, kwargs, 0, "input")
    weight, bias = arg(args, kwargs, 2, "weight"), arg(args, kwargs, 3, "bias")
    return LAYER_NORM_FLOPS * inp.numel() + _affine(inp, weight, bias), 0


def rms_norm(out, args, kwargs) -> Result:
    """F.rms_norm/torch.rms_norm(input, normalized_shape, weight, eps)."""
    inp = arg(args, kwargs, 0, "input")
    weight = arg(args, kwargs, 2, "weight")
    return RMS_NORM_FLOPS * inp.numel() + _affine(inp, weight, None), 0


def group_norm(out, args, kwargs) -> Result:
    """F.group_norm/torch.group_norm(input, num_groups, weight, bias, eps): statistics per group."""
    inp = arg(args, kwargs, 0, "input")
    weight, bias = arg(args, kwargs, 2, "weight"), arg(args, kwargs, 3, "bias")
    return LAYER_NORM_FLOPS * inp.numel() + _affine(inp, weight, bias), 0


def _stats_norm(inp, weight, bias, from_input: bool) -> Result:
    per = LAYER_NORM_FLOPS if from_input else NORMALIZE_FROM_STATS_FLOPS
    return per * inp.numel() + _affine(inp, weight, bias), 0


def batch_norm_functional(out, args, kwargs) -> Result:
    """F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)."""
    inp = arg(args, kwargs, 0, "input")
    running_mean = arg(args, kwargs, 1, "running_mean")
    training = arg(args, kwargs, 5, "training", False)
    return _stats_norm(inp, arg(args, kwargs, 3, "weight"), arg(args, kwargs, 4, "bias"),
                       training or running_mean is None)


def batch_norm_torch(out, args, kwargs) -> Result:
    """torch.batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn)."""
    inp = arg(args, kwargs, 0, "input")
    running_mean = arg(args, kwargs, 3, "running_mean")
    training = arg(args, kwargs, 5, "training", False)
    return _stats_norm(inp, arg(args, kwargs, 1, "weight"), arg(args, kwargs, 2, "bias"),
                       training or running_mean is None)


def instance_norm_functional(out, args, kwargs) -> Result:
    """F.instance_norm(input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps)."""
    inp = arg(args, kwargs, 0, "input")
    use_input_stats = arg(args, kwargs, 5, "use_input_stats", True)
    return _stats_norm(inp, arg(args, kwargs, 3, "weight"), arg(args, kwargs, 4, "bias"), use_input_stats)


def instance_norm_torch(out, args, kwargs) -> Result:
    """torch.instance_norm(input, weight, bias, running_mean, running_var, use_input_stats, ...)."""
    inp = arg(args, kwargs, 0, "input")
    use_input_stats = arg(args, kwargs, 5, "use_input_stats", True)
    return _stats_norm(inp, arg(args, kwargs, 1, "weight"), arg(args, kwargs, 2, "bias"), use_input_stats)


def normalize(out, args, kwargs) -> Result:
    """F.normalize: |x|^p (1), sum (1), divide (1) per element."""
    return reduction(3)(out, args, kwargs)


# -- pooling and interpolation --------------------------------------------------------------------

def _kernel_elements(kernel, spatial_dims: int) -> int:
    if isinstance(kernel, int):
        return kernel ** spatial_dims
    return math.prod(kernel)


def pool(spatial_dims: int, kernel_index: int = 1):
    """max/avg pooling: each output element reduces its kernel window (one flop per element)."""

    def count(out, args, kwargs) -> Result:
        result = first_tensor(out)
        kernel = arg(args, kwargs, kernel_index, "kernel_size")
        return result.numel() * _kernel_elements(kernel, spatial_dims), 0

    count.__name__ = f"pool{spatial_dims}d"
    return count


def _window_sum(in_size: int, out_size: int) -> int:
    """Sum of the adaptive windows' lengths along one dimension (PyTorch's start/end rule)."""
    return sum(
        -((-(i + 1) * in_size) // out_size) - (i * in_size) // out_size for i in range(out_size)
    )


def _adaptive_elements(inp: Tensor, result: Tensor, spatial_dims: int) -> int:
    outer = result.numel() // max(1, math.prod(result.shape[-spatial_dims:]))
    windows = math.prod(
        _window_sum(inp.shape[-spatial_dims + d], result.shape[-spatial_dims + d]) for d in range(spatial_dims)
    )
    return outer * windows


def adaptive_pool(spatial_dims: int):
    """adaptive avg/max pooling: one flop per element of every output's window, windows exact."""

    def count(out, args, kwargs) -> Result:
        inp = arg(args, kwargs, 0, "input")
        return _adaptive_elements(inp, first_tensor(out), spatial_dims), 0

    count.__name__ = f"adaptive_pool{spatial_dims}d"
    return count


# Input taps per output element; a weighted sum of t taps costs 2t - 1 flops.
_INTERPOLATION_TAPS = {"linear": 2, "bilinear": 4, "trilinear": 8, "bicubic": 16}


def interpolate(out, args, kwargs) -> Result:
    """F.interpolate: nearest modes copy (0); linear family 2t-1 per output; area is adaptive avg."""
    inp = arg(args, kwargs, 0, "input")
    mode = arg(args, kwargs, 3, "mode", "nearest")
    if mode == "area":
        return _adaptive_elements(inp, out, inp.dim() - 2), 0
    taps = _INTERPOLATION_TAPS.get(mode)
    if taps is None:  # nearest, nearest-exact
        return NOTHING
    return (2 * taps - 1) * out.numel(), 0


# -- embeddings, dropout, losses ------------------------------------------------------------------

def zero(out, args, kwargs) -> Result:
    """Known ops that do no arithmetic (embedding lookups)."""
    return NOTHING


def embedding_bag(out, args, kwargs) -> Result:
    """Sum/mean/max of the gathered rows: one flop per gathered element (+1 per weighted row
    element, + one divide per output element for ``mean``)."""
    indices = arg(args, kwargs, 0, "input")
    weight = arg(args, kwargs, 1, "weight")
    mode = arg(args, kwargs, 6, "mode", "mean")
    per_sample_weights = arg(args, kwargs, 8, "per_sample_weights")
    gathered = indices.numel() * weight.shape[-1]
    flops = gathered * (2 if per_sample_weights is not None else 1)
    if mode == "mean":
        flops += first_tensor(out).numel()
    return flops, 0


def dropout(training_index: int, training_default: bool = True):
    """Dropout multiplies by the scaled mask in training (1 per element), is free otherwise."""

    def count(out, args, kwargs) -> Result:
        p = arg(args, kwargs, 1, "p", 0.5)
        training = arg(args, kwargs, training_index, "training", training_default)
        if "train" in kwargs:
            training = kwargs["train"]
        if not training or p == 0:
            return NOTHING
        return per_element(1)(out, args, kwargs)

    count.__name__ = "dropout"
    return count


def _reduced(reduction_mode: str, n: int) -> int:
    return n if reduction_mode != "none" else 0


def cross_entropy(out, args, kwargs) -> Result:
    """log_softmax (5 per logit) + the mean/sum over the picked log-probabilities (1 per target)."""
    logits = arg(args, kwargs, 0, "input")
    target = arg(args, kwargs, 1, "target")
    reduction_mode = arg(args, kwargs, 6, "reduction", "mean")
    n = target.numel() if not _floating(target) else logits.numel()
    return SOFTMAX_FLOPS * logits.numel() + _reduced(reduction_mode, n), 0


def nll_loss(out, args, kwargs) -> Result:
    target = arg(args, kwargs, 1, "target")
    return _reduced(arg(args, kwargs, 6, "reduction", "mean"), target.numel()), 0


def pointwise_loss(out, args, kwargs) -> Result:
    """mse/l1: difference and square (or abs), 2 per element, + 1 per element for the reduction."""
    inp = arg(args, kwargs, 0, "input")
    return 2 * inp.numel() + _reduced(arg(args, kwargs, 4, "reduction", "mean"), inp.numel()), 0
