"""Random-LTD (``data_efficiency.data_routing.random_ltd``) as a part of the engine, built from its section, the
global batch size and the model (the data sampler is `_data_sampling`'s; ``data_sampling.dynamic_batching`` is
read by the script's variable-batch loader builder, not by the engine, as in DeepSpeed).

* at initialisation: ``scheduler`` (a `ds_data.RandomLTDScheduler`, or None; the engine's
  ``random_ltd_scheduler``), and the model's `ds_data.RandomLayerTokenDrop` wrappers configured
  (`initialize_layers`; `ds_data.convert_to_random_ltd` on the engine calls it again after wrapping);
* forward, in training: ``update_seq(global_steps)`` (DeepSpeed's forward prologue), then every chosen wrapper's
  ``reserved_length`` set to the current value; in evaluation the wrappers are the plain layers;
* checkpoints: the scheduler's state (`state_dict`), restored by ``load_checkpoint``.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from ds_data import RandomLayerTokenDrop, RandomLTDScheduler

logger = logging.getLogger(__name__)
RANDOM_LTD = "data_efficiency.data_routing.random_ltd"


class RandomLTD:
    """The schedule of a ``random_ltd`` section and the model's chosen wrappers (see the module docstring)."""

    def __init__(self, section: Any, *, global_batch_size: int, module: nn.Module) -> None:
        self.section, self.module = section, module
        self.layers: list[RandomLayerTokenDrop] = []
        self.warned = False
        self.scheduler = RandomLTDScheduler(section, global_batch_size=global_batch_size) if section.enabled else None
        if self.scheduler is not None and any(isinstance(m, RandomLayerTokenDrop) for m in module.modules()):
            self.initialize_layers()

    @staticmethod
    def pipeline_refusal(config: Any, module: nn.Module) -> Exception | None:
        """Why a `PipelineEngine` cannot train with random-LTD (None: it is off)."""
        if not config.data_efficiency.data_routing.random_ltd.enabled:
            return None
        return NotImplementedError(f"{RANDOM_LTD} with a PipelineModule is not implemented in ds-all: the schedule "
                                   "runs the stages' forwards, which the engine's random-LTD schedule does not reach")

    def initialize_layers(self) -> None:
        """DeepSpeed's ``random_ltd_initialize``: the wrappers of ``random_ltd_layer_id`` (indices among the model's
        wrappers, in module order) take the section's options and follow the schedule; the others stay plain."""
        if self.scheduler is None:
            raise RuntimeError(f"engine.random_ltd_initialize: random-LTD is off ({RANDOM_LTD}.enabled is false)")
        section = self.section
        wrappers = [m for m in self.module.modules() if isinstance(m, RandomLayerTokenDrop)]
        ids = sorted(section.random_ltd_layer_id)
        if not wrappers or ids[-1] >= len(wrappers):
            raise ValueError(f"{RANDOM_LTD}.random_ltd_layer_id {ids} out of range: the model has {len(wrappers)} "
                             "random-LTD layers (wrap them with ds_data.convert_to_random_ltd)")
        if len(wrappers) != section.total_layer_num:
            logger.warning("%s.total_layer_num is %d but the model has %d random-LTD layers (the layer-token count "
                           "uses total_layer_num)", RANDOM_LTD, section.total_layer_num, len(wrappers))
        for wrapper in wrappers:
            wrapper.reserved_length = None
        self.layers = [wrappers[i] for i in ids]
        for i, wrapper in zip(ids, self.layers, strict=True):
            wrapper.init_config(section, i)

    def before_forward(self, global_steps: int) -> None:
        """A training forward: the schedule at ``global_steps`` into every chosen wrapper."""
        if self.scheduler is None:
            return
        length = self.scheduler.update_seq(global_steps)
        if not self.layers and not self.warned:
            self.warned = True
            logger.warning("%s is enabled but the model has no random-LTD layers: wrap them with "
                           "ds_data.convert_to_random_ltd(engine, LayerClass)", RANDOM_LTD)
        for wrapper in self.layers:
            wrapper.reserved_length = length

    def state_dict(self) -> dict[str, Any] | None:
        return self.scheduler.state_dict() if self.scheduler is not None else None

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        if self.scheduler is not None and saved is not None:
            self.scheduler.load_state_dict(saved)
