"""The engine's wiring of ds-data: the top-level ``curriculum_learning`` section (DeepSpeed's legacy
sequence-length curriculum) and ``progressive_layer_drop``, as DeepSpeed's engine did before 0.19 removed them.

* forward, in training: ``progressive_layer_drop=True, pld_theta=θ`` (`ds_data.ProgressiveLayerDrop.get_state`),
  and ``curriculum_seqlen=<difficulty>`` after ``update_difficulty(global_steps + 1)`` (`curriculum_type` seqlen);
  a `PipelineEngine` updates the difficulty at each ``train_batch`` and passes nothing, as DeepSpeed's;
* at each accumulation boundary, before ``global_steps`` counts the step: ``update_state(global_steps)``;
* checkpoints: both objects' state in the engine's metadata, restored by ``load_checkpoint``.

``data_efficiency``: random-LTD (and the refusal of what is not wired) is `_random_ltd`'s, the data sampler
`_data_sampling`'s; their states are saved and restored from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ds_data import CurriculumScheduler, ProgressiveLayerDrop

from . import _data_sampling, _random_ltd

if TYPE_CHECKING:
    from ._engine import DeepSpeedEngine


def configure(engine: DeepSpeedEngine) -> None:
    """``engine.progressive_layer_drop`` and ``engine.curriculum_scheduler_legacy``: the objects, or None
    when their section is off."""
    config = engine.config
    pld = config.progressive_layer_drop
    engine.progressive_layer_drop = ProgressiveLayerDrop(theta=pld.theta, gamma=pld.gamma) if pld.enabled else None
    curriculum = config.curriculum_learning
    engine.curriculum_scheduler_legacy = CurriculumScheduler(curriculum) if curriculum.enabled else None
    _random_ltd.configure(engine)


def forward_kwargs(engine: DeepSpeedEngine, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of the model's forward with what the enabled sections add (training only)."""
    if not engine.module.training:
        return kwargs
    _random_ltd.before_forward(engine)
    if engine.progressive_layer_drop is not None:
        kwargs.update(engine.progressive_layer_drop.get_state())
    scheduler = engine.curriculum_scheduler_legacy
    if scheduler is not None:
        scheduler.update_difficulty(engine.global_steps + 1)
        if engine.config.curriculum_learning.curriculum_type == "seqlen":
            kwargs["curriculum_seqlen"] = scheduler.get_current_difficulty()
    return kwargs


def before_pipeline_batch(engine: DeepSpeedEngine) -> None:
    """A pipeline's ``train_batch``: the difficulty moves as the plain engine's forward moves it."""
    if engine.curriculum_scheduler_legacy is not None:
        engine.curriculum_scheduler_legacy.update_difficulty(engine.global_steps + 1)


def at_boundary(engine: DeepSpeedEngine) -> None:
    """An optimizer step (applied or skipped), before ``global_steps`` counts it."""
    if engine.progressive_layer_drop is not None:
        engine.progressive_layer_drop.update_state(engine.global_steps)


def state(engine: DeepSpeedEngine) -> dict[str, Any]:
    """What a checkpoint's metadata keeps (JSON values)."""
    pld, scheduler = engine.progressive_layer_drop, engine.curriculum_scheduler_legacy
    return {"curriculum_learning": scheduler.state_dict() if scheduler is not None else None,
            "progressive_layer_drop": pld.state_dict() if pld is not None else None,
            "random_ltd": _random_ltd.state(engine), "data_sampler": _data_sampling.state(engine)}


def restore(engine: DeepSpeedEngine, saved: dict[str, Any] | None) -> None:
    """A checkpoint's `state`, into the objects this engine has (a section off here ignores its state; a
    checkpoint without one leaves the object as it is)."""
    saved = saved or {}
    if engine.curriculum_scheduler_legacy is not None and saved.get("curriculum_learning") is not None:
        engine.curriculum_scheduler_legacy.load_state_dict(saved["curriculum_learning"])
    if engine.progressive_layer_drop is not None and saved.get("progressive_layer_drop") is not None:
        engine.progressive_layer_drop.load_state_dict(saved["progressive_layer_drop"])
    _random_ltd.restore(engine, saved.get("random_ltd"))
    _data_sampling.restore(engine, saved.get("data_sampler"))
