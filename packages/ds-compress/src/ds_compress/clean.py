"""``redundancy_clean``: make the compression permanent, so the saved model is really smaller.

Sparse masks are multiplied into the weights; pruned rows, heads and channels are cut out of the
weights and of their ``related_modules`` (next layer's input columns, Q/K/V rows, BatchNorm
features).  Quantized weights become their quantized values, as in DeepSpeed: ``module.weight``
stays a float ``Parameter`` (so weight tying, ``state_dict`` loading into the plain model and
exporters keep working) and the forward stops quantizing it.  With ``pack=True`` they are stored
instead as packed integer codes (two per byte at <= 4 bits) with a float scale per group, and
``module.weight`` is ``None``.  Either way the cleaned model computes the same function.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from .compress import ChannelMaskHook, _check_mpu, plan
from .config import SECTION, CompressionConfig
from .layers import _SCORES, PRUNING_KINDS, _CompressMixin
from .quantization import pack_values, quantize_for_storage
from .scheduler import compressed_modules

logger = logging.getLogger(__name__)


def _param(t: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(t.detach().clone().contiguous(), requires_grad=like.requires_grad)


def _keep_out(module: nn.Module, keep: torch.Tensor) -> None:
    """Keep only the output rows (Linear) or channels (Conv2d) where ``keep``."""
    module.weight = _param(module.weight[keep], module.weight)
    if module.bias is not None:
        module.bias = _param(module.bias[keep], module.bias)
    quantized = getattr(module, "_clean_quantized", None)
    if quantized is not None:
        scale, zero_point = quantized
        if scale.numel() != keep.numel():
            raise ValueError(f"{module._label()}: weight_quantization.shared_parameters.quantize_groups "
                             f"must divide the {keep.numel()} rows of a pruned layer, got {scale.numel()} groups")
        module._clean_quantized = (scale[keep], zero_point[keep])
    if isinstance(module, nn.Linear):
        module.out_features = int(keep.sum())
    else:
        module.out_channels = int(keep.sum())


def _keep_in(module: nn.Module, keep: torch.Tensor, key: str) -> None:
    """Keep only the inputs (Linear columns, Conv2d input channels, BatchNorm features) where ``keep``."""
    if isinstance(module, nn.BatchNorm2d):
        for name in ("weight", "bias"):
            if getattr(module, name) is not None:
                setattr(module, name, _param(getattr(module, name)[keep], getattr(module, name)))
        for name in ("running_mean", "running_var"):
            if getattr(module, name) is not None:
                setattr(module, name, getattr(module, name)[keep].clone())
        module.num_features = int(keep.sum())
        return
    if isinstance(module, nn.Conv2d) and module.groups != 1:
        raise ValueError(f"{key}: related module has groups={module.groups}; only groups=1 convs can be resized")
    quantized = getattr(module, "_clean_quantized", None)
    if quantized is not None and quantized[0].numel() != module.weight.shape[0]:
        raise ValueError(f"{module._label()}: weight_quantization.shared_parameters.quantize_groups must "
                         f"divide the {module.weight.shape[0]} rows of a layer whose inputs are pruned")
    if module.weight.shape[1] != keep.numel():
        raise ValueError(f"{key}: related module has {module.weight.shape[1]} inputs but the pruned "
                         f"module has {keep.numel()} outputs")
    module.weight = _param(module.weight[:, keep], module.weight)
    if isinstance(module, nn.Linear):
        module.in_features = int(keep.sum())
    else:
        module.in_channels = int(keep.sum())


def _drop(module: _CompressMixin, kind: str) -> None:
    module.pruning.pop(kind, None)
    module.pruning_enabled.pop(kind, None)
    setattr(module, f"{kind}_mask", None)
    if hasattr(module, _SCORES[kind]):
        delattr(module, _SCORES[kind])


@torch.no_grad()
def redundancy_clean(model: nn.Module, config: Any, mpu: Any = None, *, pack: bool = False) -> nn.Module:
    """Apply the compression for good (see the module docstring); returns ``model``.

    Only techniques that are on (their ``schedule_offset`` reached) are applied; the others are
    removed, which leaves the function unchanged.  ``pack=False`` (DeepSpeed's behaviour): quantized
    weights stay float parameters holding values on the quantization grid.  ``pack=True``: they are
    replaced by packed integer codes and a scale per group (buffers ``weight_codes``,
    ``weight_scale``, ``weight_zero_point``, ``weight_meta``; ``module.weight`` is ``None``), which
    makes the ``state_dict`` about ``32 / bits`` times smaller but breaks weight tying.
    """
    if not isinstance(pack, bool):
        raise ValueError(f"redundancy_clean: pack must be True or False, got {pack!r}")
    cfg = CompressionConfig.load(config)
    _check_mpu(mpu)
    modules = compressed_modules(model)
    if not modules:
        raise ValueError("redundancy_clean: the model has no compressed module; call init_compression first")
    for m in modules:
        if m.pruning_enabled.get("sparse"):
            m.weight.mul_(m.mask("sparse"))
        _drop(m, "sparse")
    entries = [e for e in plan(model, cfg) if e.technique in ("row_pruning", "head_pruning", "channel_pruning")]
    cuts = []
    for e in entries:
        module, kind = model.get_submodule(e.name), e.technique.split("_")[0]
        if not module.pruning_enabled.get(kind):
            logger.warning("redundancy_clean: %s of %s never started (schedule_offset not reached); not applied",
                           e.technique, e.name)
            continue
        cuts.append((e, module, kind, module.mask(kind).detach().reshape(-1).bool()))
    # Quantize now, on the weights the forward quantizes (masked, original shape), keeping each
    # row's scale, so that cutting rows and columns below leaves every value exact.
    # All values are computed before any is written: a weight tied between two quantized modules
    # (an embedding and its output head) must not be quantized a second time from its quantized value.
    quantized_values: dict[int, tuple[torch.Tensor, str]] = {}
    quantized: list[_CompressMixin] = []
    for m in modules:
        spec = m.weight_quantization
        if spec is not None and m.weight_quantization_enabled and m.weight is not None:
            values, scale, zero_point = quantize_for_storage(m.masked_weight()[0].detach(), m.weight_bits,
                                                             spec.groups, spec.quantization_type)
            first = quantized_values.setdefault(id(m.weight), (values, m._label()))
            if first[0] is not values and not torch.equal(first[0], values):
                raise ValueError(f"redundancy_clean: {first[1]} and {m._label()} share one weight but quantize "
                                 "it differently (weight_quantization groups with different bits or "
                                 "quantize_groups); give tied weights the same settings")
            quantized.append(m)
            if pack:  # each storage unit's scale, cut below with the rows it belongs to
                m._clean_quantized = (scale, zero_point)
    for m in quantized:
        m.weight.copy_(quantized_values[id(m.weight)][0])
    for e, module, kind, keep in cuts:
        key = f"{SECTION}.{e.technique}.different_groups.{e.group}"
        if kind == "head":
            heads = keep.numel()
            _keep_in(module, keep.repeat_interleave(module.in_features // heads), key)
            for rname in e.related:
                related = model.get_submodule(rname)
                _keep_out(related, keep.repeat_interleave(related.out_features // heads))
        else:
            _keep_out(module, keep)
            for rname in e.related:
                _keep_in(model.get_submodule(rname), keep, key)
    for bn in model.modules():
        for hook_id, hook in list(bn._forward_hooks.items()):
            if isinstance(hook, ChannelMaskHook):
                del bn._forward_hooks[hook_id]
    for m in modules:
        m.input_masks, m.head_outputs = [], []
        for kind in PRUNING_KINDS:
            _drop(m, kind)
    for m in quantized:
        spec = m.weight_quantization
        if pack:
            store = pack_values(m.weight.detach(), *m._clean_quantized, m.weight_bits, spec.quantization_type)
            del m._clean_quantized
            for name, value in store.items():
                m.register_buffer(f"weight_{name}", value)
            m.weight_store_type = spec.quantization_type
            m.register_parameter("weight", None)
        else:
            # The weight holds its quantized values now; quantizing them again in the forward
            # would move them (a grid's largest value sets the next grid's scale).  DeepSpeed's
            # fix_weight_quantization turns it off the same way.
            m.weight_quantization, m.weight_quantization_enabled = None, False
    return model
