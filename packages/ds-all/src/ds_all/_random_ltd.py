"""The engine's wiring of the ``data_efficiency`` section's random-LTD (``data_routing.random_ltd``; the data
sampler is `_data_sampling`'s; ``data_sampling.dynamic_batching`` is read by the script's variable-batch loader
builder, not by the engine, as in DeepSpeed).

* at initialisation: ``engine.random_ltd_scheduler`` (a `ds_data.RandomLTDScheduler`, or None), and the model's
  `ds_data.RandomLayerTokenDrop` wrappers configured (`initialize_layers`; `ds_data.convert_to_random_ltd` on
  the engine calls it again after wrapping);
* forward, in training: ``update_seq(global_steps)`` (DeepSpeed's forward prologue), then every chosen wrapper's
  ``reserved_length`` set to the current value; in evaluation the wrappers are the plain layers;
* checkpoints: the scheduler's state, restored by ``load_checkpoint``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ds_data import RandomLayerTokenDrop, RandomLTDScheduler

if TYPE_CHECKING:
    from ._engine import DeepSpeedEngine

logger = logging.getLogger(__name__)
RANDOM_LTD = "data_efficiency.data_routing.random_ltd"


def configure(engine: DeepSpeedEngine) -> None:
    """``engine.random_ltd_scheduler`` (None with random-LTD off) and the wrappers' options."""
    section = engine.config.data_efficiency
    random_ltd = section.data_routing.random_ltd
    engine._random_ltd_layers = []
    engine._random_ltd_warned = False
    engine.random_ltd_scheduler = None
    if random_ltd.enabled:
        engine.random_ltd_scheduler = RandomLTDScheduler(random_ltd, global_batch_size=engine.config.train_batch_size)
        if any(isinstance(m, RandomLayerTokenDrop) for m in engine.module.modules()):
            initialize_layers(engine)


def initialize_layers(engine: DeepSpeedEngine) -> None:
    """DeepSpeed's ``random_ltd_initialize``: the wrappers of ``random_ltd_layer_id`` (indices among the model's
    wrappers, in module order) take the section's options and follow the schedule; the others stay plain."""
    if engine.random_ltd_scheduler is None:
        raise RuntimeError(f"engine.random_ltd_initialize: random-LTD is off ({RANDOM_LTD}.enabled is false)")
    section = engine.config.data_efficiency.data_routing.random_ltd
    wrappers = [m for m in engine.module.modules() if isinstance(m, RandomLayerTokenDrop)]
    ids = sorted(section.random_ltd_layer_id)
    if not wrappers or ids[-1] >= len(wrappers):
        raise ValueError(f"{RANDOM_LTD}.random_ltd_layer_id {ids} out of range: the model has {len(wrappers)} "
                         "random-LTD layers (wrap them with ds_data.convert_to_random_ltd)")
    if len(wrappers) != section.total_layer_num:
        logger.warning("%s.total_layer_num is %d but the model has %d random-LTD layers (the layer-token count "
                       "uses total_layer_num)", RANDOM_LTD, section.total_layer_num, len(wrappers))
    for wrapper in wrappers:
        wrapper.reserved_length = None
    engine._random_ltd_layers = [wrappers[i] for i in ids]
    for i, wrapper in zip(ids, engine._random_ltd_layers, strict=True):
        wrapper.init_config(section, i)


def before_forward(engine: DeepSpeedEngine) -> None:
    """A training forward: the schedule at ``global_steps`` into every chosen wrapper."""
    scheduler = engine.random_ltd_scheduler
    if scheduler is None or not engine.module.training:
        return
    length = scheduler.update_seq(engine.global_steps)
    if not engine._random_ltd_layers and not engine._random_ltd_warned:
        engine._random_ltd_warned = True
        logger.warning("%s is enabled but the model has no random-LTD layers: wrap them with "
                       "ds_data.convert_to_random_ltd(engine, LayerClass)", RANDOM_LTD)
    for wrapper in engine._random_ltd_layers:
        wrapper.reserved_length = length


def state(engine: DeepSpeedEngine) -> dict[str, Any] | None:
    return engine.random_ltd_scheduler.state_dict() if engine.random_ltd_scheduler is not None else None


def restore(engine: DeepSpeedEngine, saved: dict[str, Any] | None) -> None:
    if engine.random_ltd_scheduler is not None and saved is not None:
        engine.random_ltd_scheduler.load_state_dict(saved)
