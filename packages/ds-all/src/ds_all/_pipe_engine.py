"""`PipelineEngine`: what `initialize` returns for a `ds_pipe.PipelineModule`.

The engine's parts (ZeRO 0-2 over the stage's data-parallel group, fp16/bf16, the schedule, monitors,
progress) around a `ds_pipe.PipelineExecutor`, whose hooks it fills: the backward multiplies the last
stage's loss by the fp16 loss scale, ``reduce_grads`` starts ZeRO's reduction of the gradients the
micro-batches accumulated (after the tied weights' gradients are summed), ``optimizer_step`` steps
ZeRO. ``train_batch`` runs one global batch (``gradient_accumulation_steps`` micro-batches).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from ds_pipe import PipelineExecutor, PipelineModule

from ._engine import DeepSpeedEngine
from ._optimizers import ONE_BIT
from ._timers import ALLREDUCE, BACKWARD, STEP

logger = logging.getLogger("ds_all")


def _repeat(loader) -> Iterator:
    while True:
        yield from loader


class PipelineEngine(DeepSpeedEngine):
    """`DeepSpeedEngine` for a `PipelineModule`: `train_batch` and `eval_batch` instead of
    forward/backward/step (DeepSpeed's PipelineEngine). Built by `initialize`."""

    def __init__(self, *, model: PipelineModule, config, **kwargs: Any) -> None:
        if config.zero_optimization.stage > 2:
            raise ValueError(f"initialize: a PipelineModule trains with zero_optimization.stage 0, 1 or 2, got "
                             f"{config.zero_optimization.stage} (stage 3 partitions the layers a stage owns whole)")
        one_bit = ONE_BIT.get(config.optimizer.type.lower()) if config.optimizer is not None else None
        if one_bit is not None:
            raise ValueError(f"initialize: optimizer.type {one_bit} does not train a PipelineModule (as in the "
                             "reference): its 1-bit messages replace the data-parallel all-reduce of a plain engine; "
                             "use Adam, AdamW or Lamb with a pipeline")
        stages = config.pipeline.stages
        if stages != "auto" and stages != model.num_stages:
            raise ValueError(f"initialize: pipeline.stages is {stages} but the PipelineModule has {model.num_stages} "
                             "stages")
        self._checkpoint_names = model.checkpoint_names()
        super().__init__(model=model, config=config, **kwargs)
        if self.zero is None:
            raise ValueError("initialize: a PipelineModule needs an optimizer (pass optimizer= or give the config an "
                             "'optimizer' section)")
        try:
            self.executor = PipelineExecutor(model, None, micro_batches=config.gradient_accumulation_steps,
                                             schedule=config.pipeline.schedule, reduce_grads=self._reduce,
                                             optimizer_step=self._optimizer_step, backward=self._backward,
                                             reduce_bucket_size=int(config.zero_optimization.reduce_bucket_size))
        except BaseException:  # nothing of ZeRO is left on the caller's model
            self.zero.close()
            raise
        self.data_iterator = _repeat(self.training_dataloader) if self.training_dataloader is not None else None
        self.micro_batches = config.gradient_accumulation_steps
        self.num_stages, self.stage_id = model.num_stages, model.stage_id

    def _zero_options(self) -> dict[str, Any]:
        # the executor accumulates the micro-batches (some weight gradients arrive outside autograd:
        # zero-bubble), then asks ZeRO to reduce once, after the tied gradients are summed
        # and a tied module's untied parameters get names of their own stage in checkpoints
        return {"gradient_accumulation_steps": 1, "reduce_in_backward": False,
                "checkpoint_names": self._checkpoint_names}

    # -- the executor's hooks ---------------------------------------------------------------------
    def _backward(self, tensors: list[torch.Tensor], grads: list) -> None:
        if len(grads) == 1 and grads[0] is None and self.zero.loss_scale != 1.0:  # the last stage's loss (fp16)
            tensors = [tensors[0].float() * self.zero.loss_scale]
        self.timers(BACKWARD).start()
        try:
            torch.autograd.backward(tensors, grads)
        finally:
            self.timers(BACKWARD).stop()

    def _reduce(self, executor: PipelineExecutor) -> None:
        self.zero.reduce_gradients()

    def _optimizer_step(self, executor: PipelineExecutor) -> None:
        self.timers(STEP).start()
        waited = self.zero.reduction_wait_s
        try:
            self._step_applied = self.zero.step()
            self.zero.zero_grad()
        finally:
            self.timers(STEP).stop()
            self.timers(ALLREDUCE).add(self.zero.reduction_wait_s - waited)

    # -- the loop -------------------------------------------------------------------------------
    def train_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """One global batch through the pipeline: ``gradient_accumulation_steps`` micro-batches of
        ``(inputs, labels)`` from ``data_iter`` (default: the ``training_data`` given to initialize),
        the optimizer step, the schedule, monitors and progress. Returns the mean loss on every stage."""
        data_iter = self._data(data_iter, "train_batch")
        loss = self.executor.train_batch(data_iter)
        self.micro_steps += self.micro_batches
        self.global_samples += self.train_batch_size()
        if self._step_applied and self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.global_steps += 1
        self._interval_steps += 1
        self._losses = loss
        self._after_boundary()
        return loss

    def eval_batch(self, data_iter: Iterator | None = None, return_logits: bool = False):
        """Forward ``gradient_accumulation_steps`` micro-batches without gradients; the mean loss on every
        stage (and with ``return_logits`` the last stage's outputs per micro-batch)."""
        return self.executor.eval_batch(self._data(data_iter, "eval_batch"), return_logits=return_logits)

    def _data(self, data_iter, call: str):
        if data_iter is not None:
            return data_iter
        if self.data_iterator is None and (self.is_first_stage() or self.is_last_stage()):
            raise ValueError(f"engine.{call}: no data for this stage (it reads inputs or labels): pass data_iter, "
                             "or training_data to initialize")
        return self.data_iterator

    def set_dataiterator(self, iterator: Iterator) -> None:
        self.data_iterator = iterator

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("PipelineEngine: the schedule runs the forward; call engine.train_batch() or eval_batch()")

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("PipelineEngine: the schedule runs the backward; call engine.train_batch()")

    def step(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("PipelineEngine: train_batch() steps the optimizer; call engine.train_batch()")
