"""ds-data's training-efficiency features as one part of the engine, built from the config and the model: the
top-level ``curriculum_learning`` section (DeepSpeed's legacy sequence-length curriculum) and
``progressive_layer_drop``, as DeepSpeed's engine did before 0.19 removed them, with random-LTD
(`_random_ltd.RandomLTD`) and the data sampler's position (`_data_sampling.SamplerPosition`, given once the
training loader exists).

* forward, in training (`forward_kwargs`): random-LTD's length at ``global_steps``; ``progressive_layer_drop=True,
  pld_theta=θ`` (`ds_data.ProgressiveLayerDrop.get_state`), and ``curriculum_seqlen=<difficulty>`` after
  ``update_difficulty(global_steps + 1)`` (`curriculum_type` seqlen); a `PipelineEngine` updates the difficulty at
  each ``train_batch`` (`before_pipeline_batch`) and passes nothing, as DeepSpeed's;
* at each accumulation boundary, before ``global_steps`` counts the step (`at_boundary`): ``update_state``;
* checkpoints: the four states under ``data_efficiency`` in the engine's metadata (`state_dict`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ds_data import CurriculumScheduler, ProgressiveLayerDrop

from ._data_sampling import SamplerPosition
from ._random_ltd import RandomLTD
from ._train_state import Restore


class DataEfficiency:
    """The objects of the enabled sections (None when off) and their hooks (see the module docstring)."""

    restore = Restore.RUN

    def __init__(self, config: Any, module: nn.Module) -> None:
        pld = config.progressive_layer_drop
        self.progressive_layer_drop = ProgressiveLayerDrop(theta=pld.theta, gamma=pld.gamma) if pld.enabled else None
        curriculum = config.curriculum_learning
        self.curriculum_scheduler_legacy = CurriculumScheduler(curriculum) if curriculum.enabled else None
        self.seqlen = curriculum.curriculum_type == "seqlen"
        self.random_ltd = RandomLTD(config.data_efficiency.data_routing.random_ltd,
                                    global_batch_size=config.train_batch_size, module=module)
        self.data_sampler = SamplerPosition()  # its ``loader``: the engine's training loader

    @staticmethod
    def pipeline_refusal(config: Any, module: nn.Module) -> Exception | None:
        """Why a `PipelineEngine` cannot train with these sections (None: it can): progressive layer drop, then
        random-LTD's and the data sampler's own reasons."""
        if config.progressive_layer_drop.enabled:
            return NotImplementedError("progressive_layer_drop with a PipelineModule is not implemented in ds-all: the "
                                       "schedule runs the stages' forwards, so the engine cannot pass pld_theta (nor "
                                       "does DeepSpeed's PipelineEngine); drop layers in the stages' own code")
        return RandomLTD.pipeline_refusal(config, module) or SamplerPosition.pipeline_refusal(config, module)

    def forward_kwargs(self, kwargs: dict[str, Any], *, global_steps: int) -> dict[str, Any]:
        """The keyword arguments of a training forward with what the enabled sections add."""
        self.random_ltd.before_forward(global_steps)
        if self.progressive_layer_drop is not None:
            kwargs.update(self.progressive_layer_drop.get_state())
        scheduler = self.curriculum_scheduler_legacy
        if scheduler is not None:
            scheduler.update_difficulty(global_steps + 1)
            if self.seqlen:
                kwargs["curriculum_seqlen"] = scheduler.get_current_difficulty()
        return kwargs

    def before_pipeline_batch(self, global_steps: int) -> None:
        """A pipeline's ``train_batch``: the difficulty moves as the plain engine's forward moves it."""
        if self.curriculum_scheduler_legacy is not None:
            self.curriculum_scheduler_legacy.update_difficulty(global_steps + 1)

    def at_boundary(self, global_steps: int) -> None:
        """An optimizer step (applied or skipped), before ``global_steps`` counts it."""
        if self.progressive_layer_drop is not None:
            self.progressive_layer_drop.update_state(global_steps)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint's metadata keeps (JSON values)."""
        pld, scheduler = self.progressive_layer_drop, self.curriculum_scheduler_legacy
        return {"curriculum_learning": scheduler.state_dict() if scheduler is not None else None,
                "progressive_layer_drop": pld.state_dict() if pld is not None else None,
                "random_ltd": self.random_ltd.state_dict(),
                "data_sampler": self.data_sampler.state_dict()}

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        """A checkpoint's `state_dict`, into the objects this engine has (a section off here ignores its state; a
        checkpoint without one leaves the object as it is)."""
        saved = saved or {}
        if self.curriculum_scheduler_legacy is not None and saved.get("curriculum_learning") is not None:
            self.curriculum_scheduler_legacy.load_state_dict(saved["curriculum_learning"])
        if self.progressive_layer_drop is not None and saved.get("progressive_layer_drop") is not None:
            self.progressive_layer_drop.load_state_dict(saved["progressive_layer_drop"])
        self.random_ltd.load_state_dict(saved.get("random_ltd"))
        self.data_sampler.load_state_dict(saved.get("data_sampler"))
