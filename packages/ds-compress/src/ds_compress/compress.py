"""``init_compression`` and ``redundancy_clean``: which modules each group names, and what is done to them."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .config import SECTION, TECHNIQUES, CompressionConfig
from .layer_reduction import reduce_layers
from .layers import COMPRESSED, PruningSpec, WeightQuantizationSpec, _CompressMixin

logger = logging.getLogger(__name__)

_TARGETS: dict[str, tuple[type[nn.Module], ...]] = {
    "weight_quantization": (nn.Linear, nn.Conv2d, nn.Embedding),
    "activation_quantization": (nn.Linear, nn.Conv2d),
    "sparse_pruning": (nn.Linear, nn.Conv2d),
    "row_pruning": (nn.Linear,),
    "head_pruning": (nn.Linear,),
    "channel_pruning": (nn.Conv2d,),
}
# What "modules": null means (the reference: "All Linear and CONV2D layers", "All CONV2D layers").
_DEFAULT = {"weight_quantization": (nn.Linear, nn.Conv2d), "channel_pruning": (nn.Conv2d,)}
_RELATED = {"row_pruning": (nn.Linear,), "head_pruning": (nn.Linear,),
            "channel_pruning": (nn.Conv2d, nn.BatchNorm2d)}


@dataclass
class Entry:
    """One module a group compresses, with the modules that follow its pruned dimension."""

    technique: str
    group: str
    name: str
    params: Any
    related: list[str] = field(default_factory=list)


def _is(module: nn.Module, types: tuple[type[nn.Module], ...]) -> bool:
    """Exact types (a subclass may compute differently, e.g. MultiheadAttention's out_proj)."""
    return any(type(module) is t or type(module) is COMPRESSED.get(t) for t in types)


def _compile(pattern: str, key: str) -> re.Pattern:
    """``pattern`` compiled; a bad regular expression is a ValueError naming the key it came from."""
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{key}: {pattern!r} is not a valid regular expression ({e})") from None


def _match(model: nn.Module, pattern: str | None, types, key: str = "modules") -> list[str]:
    regex = None if pattern is None else _compile(pattern, key)
    return [name for name, module in model.named_modules()
            if name and _is(module, types) and (regex is None or regex.search(name))]


def plan(model: nn.Module, config: CompressionConfig) -> list[Entry]:
    """Every (technique, group, module) of the enabled techniques; errors name the key and pattern."""
    entries: list[Entry] = []
    for technique in TECHNIQUES:
        section = getattr(config, technique)
        shared = section.shared_parameters
        if not shared.enabled:
            continue
        excluded = [_compile(x, f"{SECTION}.{technique}.shared_parameters.excluded_modules")
                    for x in getattr(shared, "excluded_modules", [])]
        owner: dict[str, str] = {}
        for group_name, group in section.different_groups.items():
            key = f"{SECTION}.{technique}.different_groups.{group_name}"
            patterns = group.modules if group.modules is not None else [None]
            related_lists = getattr(group, "related_modules", None)
            if related_lists is not None and len(related_lists) != len(patterns):
                raise ValueError(f"{key}.related_modules must have one list per pattern of modules "
                                 f"({len(patterns)}), got {len(related_lists)}")
            for i, pattern in enumerate(patterns):
                types = _DEFAULT.get(technique, _TARGETS[technique]) if pattern is None else _TARGETS[technique]
                names = [n for n in _match(model, pattern, types, f"{key}.modules")
                         if not any(x.search(n) for x in excluded)]
                if not names:  # DeepSpeed skips it (one config may serve several models); we say so
                    kinds = "/".join(t.__name__ for t in types)
                    logger.warning("%s.modules: pattern %r matches no %s module of the model; nothing of it is "
                                   "compressed", key, pattern, kinds)
                    continue
                for name in names:
                    if name in owner:
                        raise ValueError(f"{key}.modules: {name!r} is already compressed by group "
                                         f"{owner[name]!r} of {technique}")
                    owner[name] = group_name
                related: list[list[str]] = [[] for _ in names]
                for rpattern in (related_lists[i] if related_lists is not None else []):
                    rnames = _match(model, rpattern, _RELATED[technique], f"{key}.related_modules")
                    if len(rnames) != len(names):
                        raise ValueError(f"{key}.related_modules: pattern {rpattern!r} matches {len(rnames)} "
                                         f"modules {rnames[:4]} but modules pattern {pattern!r} matches "
                                         f"{len(names)}; they are paired in model order")
                    for j, rname in enumerate(rnames):
                        related[j].append(rname)
                entries += [Entry(technique, group_name, n, group.params, r) for n, r in zip(names, related, strict=True)]
    return entries


def _check_mpu(mpu: Any) -> None:
    if mpu is not None and hasattr(mpu, "get_model_parallel_world_size") and mpu.get_model_parallel_world_size() > 1:
        raise ValueError("ds-compress compresses whole (not tensor-parallel) layers; got an mpu with model "
                         f"parallel world size {mpu.get_model_parallel_world_size()}")


def init_compression(model: nn.Module, config: Any, teacher_model: nn.Module | None = None,
                     mpu: Any = None) -> nn.Module:
    """Replace the modules named by ``compression_training`` with compression-aware ones; returns ``model``.

    ``config``: a ``CompressionConfig``, a dict (the section or a whole ds config) or a JSON path.
    Techniques whose ``schedule_offset`` is 0 are on at once; ``CompressionScheduler.step()`` turns
    on the others and runs the bit-width schedule.  Create the optimizer after this call: ``topk``
    pruning adds learnable score parameters.
    """
    cfg = CompressionConfig.load(config)
    _check_mpu(mpu)
    wq = cfg.weight_quantization.shared_parameters
    if wq.enabled and wq.quantizer_kernel:
        raise ValueError(f"{SECTION}.weight_quantization.shared_parameters.quantizer_kernel=true needs "
                         "DeepSpeed's fused FP16 quantizer kernel, which ds-compress does not have; set it to false")
    sp = cfg.sparse_pruning.shared_parameters
    if sp.enabled and sp.method == "snip_momentum":
        raise ValueError(f"{SECTION}.sparse_pruning.shared_parameters.method 'snip_momentum' is not "
                         "implemented in ds-compress 0.1.0; use 'l1' or 'topk'")
    if cfg.layer_reduction.enabled:
        model = reduce_layers(model, teacher_model, cfg.layer_reduction)
    for entry in plan(model, cfg):
        module = model.get_submodule(entry.name)
        COMPRESSED[next(t for t in COMPRESSED if _is(module, (t,)))].convert(module)
        module._ds_compress_name = entry.name
        _enable(module, entry, cfg)
        if entry.related:
            _link_related(model, module, entry)
    model._ds_compression_config = cfg
    from .scheduler import apply_schedule

    apply_schedule(model, cfg, 0)
    return model


class ChannelMaskHook:
    """Forward hook of a BatchNorm related to a pruned conv: a pruned channel leaves the BN as 0
    too (BN maps 0 to its shift), so cutting the channel in ``redundancy_clean`` is exact.
    An object, not a closure, so that ``copy.deepcopy(model)`` points it at the copied conv."""

    def __init__(self, conv: _CompressMixin):
        self.conv = conv

    def __call__(self, bn, args, out):
        mask = self.conv.mask("channel")
        return out if mask is None else out * mask.reshape(1, -1, 1, 1)


def _link_related(model: nn.Module, module: _CompressMixin, entry: Entry) -> None:
    kind = entry.technique.split("_")[0]
    key = f"{SECTION}.{entry.technique}.different_groups.{entry.group}.related_modules"
    for name in entry.related:
        related = model.get_submodule(name)
        if isinstance(related, nn.BatchNorm2d):
            related.register_forward_hook(ChannelMaskHook(module))
            continue
        related = COMPRESSED[next(t for t in COMPRESSED if _is(related, (t,)))].convert(related)
        related._ds_compress_name = name
        if kind == "head":
            heads = module.pruning["head"].num_heads
            if related.out_features % heads:
                raise ValueError(f"{key}: {name!r} has {related.out_features} outputs, not a multiple of "
                                 f"num_heads={heads}")
            related.head_outputs.append(module)
        else:
            inputs = related.weight.shape[1]
            outputs = module.weight.shape[0]
            if inputs != outputs:
                raise ValueError(f"{key}: {name!r} has {inputs} inputs but {entry.name!r} has {outputs} outputs")
            related.input_masks.append((module, kind))


def _enable(module: _CompressMixin, entry: Entry, cfg: CompressionConfig) -> None:
    t = entry.technique
    if t == "weight_quantization":
        shared = cfg.weight_quantization.shared_parameters
        p = entry.params
        module.enable_weight_quantization(WeightQuantizationSpec(
            p.start_bits, p.target_bits, p.quantization_period, shared.quantization_type, shared.rounding,
            shared.quantize_groups, shared.quantize_weight_in_forward, shared.fp16_mixed_quantize.enabled,
            shared.fp16_mixed_quantize.quantize_change_ratio))
    elif t == "activation_quantization":
        shared = cfg.activation_quantization.shared_parameters
        module.enable_activation_quantization(entry.params.bits, shared.quantization_type, shared.range_calibration)
    else:
        shared = getattr(cfg, t).shared_parameters
        module.enable_pruning(t.split("_")[0], PruningSpec(shared.method, entry.params.dense_ratio,
                                                           getattr(shared, "num_heads", None)))
