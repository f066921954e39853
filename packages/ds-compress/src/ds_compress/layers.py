"""Compression-aware ``nn.Linear``, ``nn.Conv2d`` and ``nn.Embedding``.

``init_compression`` turns a layer into its compressed class in place (``module.__class__`` is
swapped, so parameters, hooks and ``isinstance(m, nn.Linear)`` are kept).  The forward then uses
``effective_weight()``: the weight times the enabled pruning masks, fake-quantized when weight
quantization runs in the forward, and the input goes through the activation quantizer.  Each
technique is off until ``switch_on`` (called by the scheduler at its ``schedule_offset``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .pruning import (
    TopKBinarizer,
    channel_importance,
    head_importance,
    row_importance,
    topk_mask,
    weight_importance,
)
from .quantization import ActivationQuantizer, fake_quantize, quantize, unpack

PRUNING_KINDS = ("sparse", "row", "head", "channel")
_SCORES = {"sparse": "sparse_mask_scores", "row": "row_mask_scores", "head": "head_pruning_scores",
           "channel": "channel_mask_scores"}


@dataclass
class WeightQuantizationSpec:
    start_bits: int
    target_bits: int
    quantization_period: int
    quantization_type: str = "symmetric"
    rounding: str = "nearest"
    groups: int = 1
    in_forward: bool = True
    mixed: bool = False
    change_ratio: float = 0.001


@dataclass
class PruningSpec:
    method: str
    dense_ratio: float
    num_heads: int | None = None


class _CompressMixin:
    """State and weight transform shared by the three compressed layer classes."""

    SUPPORTED: tuple[str, ...] = ()

    def _init_compression(self) -> None:
        self.weight_quantization: WeightQuantizationSpec | None = None
        self.weight_quantization_enabled = False
        self.weight_bits: int | None = None
        self.mixed_ratio = 1.0
        self.weight_store_type: str | None = None  # set by redundancy_clean when the weight is packed
        self.activation_quantizer: ActivationQuantizer | None = None
        self.activation_quantization_enabled = False
        self.pruning: dict[str, PruningSpec] = {}
        self.pruning_enabled: dict[str, bool] = {}
        # Masks of the pruned modules this one is related to: their pruned outputs are this
        # module's inputs (row/channel) or its pruned heads are this module's outputs (Q/K/V).
        # Applying them in training changes nothing (those inputs are 0, those heads are cut) but
        # lets the quantization scale ignore what redundancy_clean will remove.
        self.input_masks: list[tuple[_CompressMixin, str]] = []
        self.head_outputs: list[_CompressMixin] = []
        for kind in PRUNING_KINDS:
            self.register_buffer(f"{kind}_mask", None)

    @classmethod
    def convert(cls, module: nn.Module) -> nn.Module:
        if not isinstance(module, cls):
            module.__class__ = cls
            module._init_compression()
        return module

    # ------------------------------------------------------------------------------ configuration
    def enable_weight_quantization(self, spec: WeightQuantizationSpec) -> None:
        if self.weight.numel() % spec.groups:
            raise ValueError(f"weight_quantization.shared_parameters.quantize_groups={spec.groups} does "
                             f"not divide the {self.weight.numel()} weights of {self._label()}")
        self.weight_quantization = spec
        self.weight_bits = spec.start_bits
        self.mixed_ratio = spec.change_ratio if spec.mixed else 1.0

    def enable_activation_quantization(self, bits: int, quantization_type: str, range_calibration: str) -> None:
        self.activation_quantizer = ActivationQuantizer(bits, quantization_type, range_calibration,
                                                        per_sample=isinstance(self, nn.Conv2d))
        self.activation_quantizer.to(self.weight.device)

    def enable_pruning(self, kind: str, spec: PruningSpec) -> None:
        if kind not in self.SUPPORTED:
            raise ValueError(f"{kind}_pruning does not apply to {type(self).__bases__[-1].__name__} "
                             f"{self._label()}")
        if kind == "head" and self.in_features % spec.num_heads:
            raise ValueError(f"head_pruning.shared_parameters.num_heads={spec.num_heads} does not divide "
                             f"in_features={self.in_features} of {self._label()}")
        self.pruning[kind] = spec
        self.pruning_enabled[kind] = False
        if spec.method == "topk":
            scores = self._importance(kind)
            scores = scores / scores.max().clamp_min(1e-12)  # scale-free start: the magnitude ranking
            self.register_parameter(_SCORES[kind], nn.Parameter(scores.clone()))

    def _importance(self, kind: str) -> torch.Tensor:
        if kind == "sparse":
            return weight_importance(self.weight)
        if kind == "row":
            return row_importance(self.weight)
        if kind == "head":
            return head_importance(self.weight, self.pruning[kind].num_heads)
        return channel_importance(self.weight)

    def switch_on(self, kind: str) -> None:
        """Turn a technique on ('weight', 'activation' or a pruning kind); l1 masks are fixed now."""
        if kind == "weight":
            self.weight_quantization_enabled = True
        elif kind == "activation":
            self.activation_quantization_enabled = True
        elif not self.pruning_enabled.get(kind, True):
            self.pruning_enabled[kind] = True
            spec = self.pruning[kind]
            if spec.method == "l1":
                setattr(self, f"{kind}_mask", topk_mask(self._importance(kind), spec.dense_ratio))

    def freeze_mask(self, kind: str) -> None:
        """Fix the current mask (topk scores stop learning); used at sparse schedule_offset_end."""
        if self.pruning_enabled.get(kind) and getattr(self, f"{kind}_mask") is None:
            setattr(self, f"{kind}_mask", self.mask(kind).detach())
            getattr(self, _SCORES[kind]).requires_grad_(False)

    # ---------------------------------------------------------------------------------- forward
    def mask(self, kind: str) -> torch.Tensor | None:
        if not self.pruning_enabled.get(kind):
            return None
        fixed = getattr(self, f"{kind}_mask")
        if fixed is not None:
            return fixed
        return TopKBinarizer.apply(getattr(self, _SCORES[kind]), self.pruning[kind].dense_ratio)

    def stored_weight(self) -> torch.Tensor:
        if self.weight is not None:
            return self.weight
        store = {k: getattr(self, f"weight_{k}") for k in ("codes", "scale", "zero_point", "meta")}
        bias = getattr(self, "bias", None)
        return unpack(store, self.weight_store_type, bias.dtype if bias is not None else torch.float32)

    def masked_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        weight, bias = self.stored_weight(), getattr(self, "bias", None)
        for owner, kind in self.input_masks:
            m = owner.mask(kind)
            if m is not None:
                weight = weight * m.reshape(1, -1, *([1] * (weight.dim() - 2)))
        for owner in self.head_outputs:
            m = owner.mask("head")
            if m is not None:
                rows = m.reshape(-1).repeat_interleave(weight.shape[0] // m.numel())
                weight = weight * rows.reshape(-1, *([1] * (weight.dim() - 1)))
                bias = bias * rows if bias is not None else None
        for kind in PRUNING_KINDS:
            m = self.mask(kind)
            if m is None:
                continue
            if kind == "head":
                out_features, in_features = weight.shape
                heads = m.numel()
                weight = (weight.reshape(out_features, heads, in_features // heads)
                          * m.reshape(1, heads, 1)).reshape(out_features, in_features)
            else:
                weight = weight * m
                if kind in ("row", "channel") and bias is not None:
                    bias = bias * m.reshape(-1)
        return weight, bias

    def quantized(self, weight: torch.Tensor) -> torch.Tensor:
        spec = self.weight_quantization
        q = fake_quantize(weight, self.weight_bits, spec.groups, spec.quantization_type, spec.rounding)
        if spec.mixed and self.mixed_ratio < 1.0:
            return (1.0 - self.mixed_ratio) * weight + self.mixed_ratio * q
        return q

    def effective_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        weight, bias = self.masked_weight()
        if self.weight_quantization_enabled and self.weight_quantization.in_forward and self.weight is not None:
            weight = self.quantized(weight)
        return weight, bias

    def quantize_weight_in_place(self) -> None:
        """quantize_weight_in_forward=false: the weight itself is replaced by its quantized value."""
        spec = self.weight_quantization
        with torch.no_grad():
            q = quantize(self.weight, self.weight_bits, spec.groups, spec.quantization_type, spec.rounding)
            if spec.mixed and self.mixed_ratio < 1.0:
                q = (1.0 - self.mixed_ratio) * self.weight + self.mixed_ratio * q
            self.weight.copy_(q)

    def _quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation_quantization_enabled and self.activation_quantizer is not None:
            return self.activation_quantizer(x)
        return x

    def _label(self) -> str:
        return getattr(self, "_ds_compress_name", type(self).__name__)


class LinearCompress(_CompressMixin, nn.Linear):
    """``nn.Linear`` with weight/activation quantization and sparse, row and head pruning."""

    SUPPORTED = ("sparse", "row", "head")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.effective_weight()
        return F.linear(self._quantize_input(x), weight, bias)


class Conv2dCompress(_CompressMixin, nn.Conv2d):
    """``nn.Conv2d`` with weight/activation quantization and sparse and channel pruning."""

    SUPPORTED = ("sparse", "channel")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.effective_weight()
        return self._conv_forward(self._quantize_input(x), weight, bias)


class EmbeddingCompress(_CompressMixin, nn.Embedding):
    """``nn.Embedding`` with weight quantization."""

    SUPPORTED = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, _ = self.effective_weight()
        return F.embedding(x, weight, self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, self.sparse)


COMPRESSED = {nn.Linear: LinearCompress, nn.Conv2d: Conv2dCompress, nn.Embedding: EmbeddingCompress}
