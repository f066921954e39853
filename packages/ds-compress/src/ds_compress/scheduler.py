"""``CompressionScheduler``: turns each technique on at its ``schedule_offset`` and runs the bit schedule."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from .config import CompressionConfig
from .layers import PRUNING_KINDS, _CompressMixin

logger = logging.getLogger(__name__)


def compressed_modules(model: nn.Module) -> list[_CompressMixin]:
    return [m for m in model.modules() if isinstance(m, _CompressMixin)]


def weight_bits(start_bits: int, target_bits: int, period: int, steps_since_offset: int) -> int:
    """The reference's schedule: one bit less every ``quantization_period`` steps, down to ``target_bits``."""
    return max(target_bits, start_bits - steps_since_offset // period)


def apply_schedule(model: nn.Module, config: CompressionConfig, step: int) -> None:
    """Set every compressed module of ``model`` to what the config says for training step ``step``."""
    modules = compressed_modules(model)
    wq = config.weight_quantization.shared_parameters
    if wq.enabled and step >= wq.schedule_offset:
        elapsed = step - wq.schedule_offset
        for m in modules:
            spec = m.weight_quantization
            if spec is None or m.weight is None:
                continue
            m.switch_on("weight")
            bits = weight_bits(spec.start_bits, spec.target_bits, spec.quantization_period, elapsed)
            if bits != m.weight_bits and wq.quantize_verbose:
                logger.info("step %d: %s weights now %d bits", step, m._label(), bits)
            m.weight_bits = bits
            if spec.mixed:
                m.mixed_ratio = min(1.0, spec.change_ratio * (elapsed + 1))
            if not spec.in_forward:
                m.quantize_weight_in_place()
    aq = config.activation_quantization.shared_parameters
    if aq.enabled and step >= aq.schedule_offset:
        for m in modules:
            if m.activation_quantizer is not None:
                m.switch_on("activation")
    for kind in PRUNING_KINDS:
        shared = getattr(config, f"{kind}_pruning").shared_parameters
        if not shared.enabled or step < shared.schedule_offset:
            continue
        end = getattr(shared, "schedule_offset_end", None)
        for m in modules:
            if kind in m.pruning:
                m.switch_on(kind)
                if end is not None and step >= end:
                    m.freeze_mask(kind)


class CompressionScheduler:
    """Call ``step()`` once per training step, after ``optimizer.step()``.

    After ``n`` calls the model is at training step ``n``: a technique is on when ``n >=
    schedule_offset``; weight quantization uses ``max(target_bits, start_bits - (n - offset) //
    quantization_period)`` bits and, with ``quantize_weight_in_forward=false``, quantizes the weights
    in place; sparse pruning masks are frozen from ``schedule_offset_end`` on.
    """

    def __init__(self, model: nn.Module, config: Any = None):
        if config is None:
            config = getattr(model, "_ds_compression_config", None)
            if config is None:
                raise ValueError("CompressionScheduler needs the compression config (or a model from init_compression)")
        self.model, self.config = model, CompressionConfig.load(config)
        if not compressed_modules(model) and not self.config.layer_reduction.enabled:
            raise ValueError("CompressionScheduler: the model has no compressed module; call init_compression first")
        self.training_steps = 0

    def step(self, step_zero_check: bool = False) -> None:
        if not step_zero_check:
            self.training_steps += 1
        apply_schedule(self.model, self.config, self.training_steps)

    def state_dict(self) -> dict[str, int]:
        return {"training_steps": self.training_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.training_steps = int(state["training_steps"])
        apply_schedule(self.model, self.config, self.training_steps)
