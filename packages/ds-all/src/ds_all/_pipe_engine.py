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

    # DeepSpeed's table of the dtypes its stages send (an id per dtype)
    ID_TO_DTYPE = [torch.float32, torch.float64, torch.complex64, torch.complex128, torch.float16, torch.bfloat16,
                   torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool]
    DTYPE_TO_ID = {dtype: id_ for id_, dtype in enumerate(ID_TO_DTYPE)}

    def _training_loader(self, training_data: Any, collate_fn: Any):
        """DeepSpeed's pipeline loader: the data-parallel share of ``training_data`` in order (its
        DistributedSampler does not shuffle), repeated by ``train_batch``."""
        return self._loader(training_data, None, True, None, collate_fn, None, shuffle=False)

    def __init__(self, *, model: PipelineModule, config, **kwargs: Any) -> None:
        if config.zero_optimization.stage > 2:
            raise ValueError(f"initialize: a PipelineModule trains with zero_optimization.stage 0, 1 or 2, got "
                             f"{config.zero_optimization.stage} (stage 3 partitions the layers a stage owns whole)")
        one_bit = ONE_BIT.get(config.optimizer.type.lower()) \
            if config.optimizer is not None and kwargs.get("optimizer") is None else None
        if one_bit is not None:
            raise ValueError(f"initialize: optimizer.type {one_bit} does not train a PipelineModule (as in the "
                             "reference): its 1-bit messages replace the data-parallel all-reduce of a plain engine; "
                             "use Adam, AdamW or Lamb with a pipeline")
        stages = config.pipeline.stages
        if stages != "auto" and stages != model.num_stages:
            raise ValueError(f"initialize: pipeline.stages is {stages} but the PipelineModule has {model.num_stages} "
                             "stages")
        if "virtual_stages" in config.pipeline.model_fields_set and \
                config.pipeline.virtual_stages != model.virtual_stages:
            raise ValueError(f"initialize: pipeline.virtual_stages is {config.pipeline.virtual_stages} but the "
                             f"PipelineModule was built with virtual_stages={model.virtual_stages} (the module's "
                             "split into chunks decides it)")
        for part in self.FEATURE_PARTS:  # what the engine's parts cannot do in a pipeline, as they declare it
            refusal = part.pipeline_refusal(config, model)
            if refusal is not None:
                raise refusal
        self._checkpoint_names = model.checkpoint_names()
        super().__init__(model=model, config=config, **kwargs)
        if self.zero is None:
            raise ValueError("initialize: a PipelineModule needs an optimizer (pass optimizer= or give the config an "
                             "'optimizer' section)")
        try:
            self.executor = PipelineExecutor(model, None, micro_batches=config.gradient_accumulation_steps,
                                             schedule=config.pipeline.schedule, reduce_grads=self._reduce,
                                             optimizer_step=self._optimizer_step, backward=self._backward,
                                             reduce_bucket_size=int(config.zero_optimization.reduce_bucket_size),
                                             pipe_partitioned=config.pipeline.pipe_partitioned,
                                             grad_partitioned=config.pipeline.grad_partitioned)
        except BaseException:  # nothing of ZeRO is left on the caller's model
            self.zero.close()
            raise
        self.data_iterator = _repeat(self.training_dataloader) if self.training_dataloader is not None else None
        self.micro_batches = config.gradient_accumulation_steps
        self.num_stages, self.stage_id = model.num_stages, model.stage_id
        self.prev_stage, self.next_stage = self.stage_id - 1, self.stage_id + 1
        self.grid, self.pipeline_parallelism = self.mpu, True
        self.is_pipe_parallel, self.is_data_parallel = self.num_stages > 1, self.dp_world_size > 1
        self.batch_fn = None  # set_batch_fn's
        self.has_attention_mask = False  # set_has_attention_mask's
        self._force_grad_boundary = False  # True while the schedule reduces and steps

    def _zero_options(self) -> dict[str, Any]:
        # the executor accumulates the micro-batches (some weight gradients arrive outside autograd:
        # zero-bubble), then asks ZeRO to reduce once, after the tied gradients are summed
        # and a tied module's untied parameters get names of their own stage in checkpoints
        # the gradient norm clipped is the whole model's: every stage's and every tensor slice's gradients
        # count (the replica's group, DeepSpeed's model-parallel group of a pipeline), a parameter replicated
        # over the tensor slices on slice 0 only
        grid = self.mpu
        tensor_parallel = grid.get_model_parallel_world_size() > 1
        return {"gradient_accumulation_steps": 1, "reduce_in_backward": False,
                "checkpoint_names": self._checkpoint_names,
                "model_parallel_group": grid.get_pipe_model_parallel_group() if tensor_parallel
                else grid.get_pipe_parallel_group(),
                "tensor_parallel_rank": grid.get_model_parallel_rank() if tensor_parallel else 0}

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
        self._force_grad_boundary = True
        try:
            self.zero.reduce_gradients()
        finally:
            self._force_grad_boundary = False

    def _optimizer_step(self, executor: PipelineExecutor) -> None:
        self._force_grad_boundary = True
        self.timers(STEP).start()
        waited = self.zero.reduction_wait_s
        try:
            self._step_applied = self.zero.step()
            self.zero.zero_grad()
        finally:
            self.timers(STEP).stop()
            self.timers(ALLREDUCE).add(self.zero.reduction_wait_s - waited)
            self._force_grad_boundary = False

    # -- the loop -------------------------------------------------------------------------------
    def train_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """One global batch through the pipeline: ``gradient_accumulation_steps`` micro-batches of
        ``(inputs, labels)`` from ``data_iter`` (default: the ``training_data`` given to initialize),
        the optimizer step, the schedule, monitors and progress. Returns the mean loss on every stage."""
        data_iter = self._data(data_iter, "train_batch")
        self.data_efficiency.before_pipeline_batch(self.global_steps)
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
        if data_iter is None:
            if self.data_iterator is None and (self.is_first_stage() or self.is_last_stage()):
                raise ValueError(f"engine.{call}: no data for this stage (it reads inputs or labels): pass "
                                 "data_iter, or training_data to initialize")
            data_iter = self.data_iterator
        if data_iter is None or self.batch_fn is None:
            return data_iter
        return map(self.batch_fn, data_iter)

    def set_dataiterator(self, iterator: Iterator) -> None:
        """Read the batches from ``iterator`` (the first and last stages read data; others ignore it)."""
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = None
            self.data_iterator = iterator

    def set_dataloader(self, loader) -> None:
        """Read the batches from ``loader`` (the first and last stages read data; others ignore it)."""
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = loader
            self.data_iterator = iter(loader)

    def set_batch_fn(self, fn) -> None:
        """Apply ``fn`` to every batch read (before the stage takes its inputs or labels from it)."""
        if fn is not None and not callable(fn):
            raise ValueError(f"set_batch_fn: fn must be callable or None, got {type(fn).__name__}")
        self.batch_fn = fn

    def set_has_attention_mask(self, value: bool) -> None:
        """DeepSpeed casts a last boolean output to half for NCCL when this is set; ds-pipe sends boolean
        tensors as they are, so the flag is only kept."""
        if not isinstance(value, bool):
            raise ValueError(f"set_has_attention_mask: value must be True or False, got {value!r}")
        self.has_attention_mask = value

    def reset_activation_shape(self) -> None:
        """The next batch's activations may have other shapes (a longer sequence); every rank calls it."""
        self.executor.reset_activation_shape()

    def _set_accumulation_steps(self, steps: int) -> None:
        self.executor.set_micro_batches(steps)  # ZeRO steps once per batch: its own accumulation stays 1
        self.micro_batches = steps

    def is_gradient_accumulation_boundary(self) -> bool:
        """True while the schedule reduces the gradients and steps the optimizer (DeepSpeed's)."""
        return self._force_grad_boundary

    def get_pipeline_parallel_rank(self) -> int:
        return self.stage_id

    def get_additional_losses(self):
        """DeepSpeed's extra losses a PipelineModule may report: none in ds-pipe (None)."""
        return None

    def module_state_dict(self, exclude_frozen_parameters: bool = False):
        raise RuntimeError("PipelineEngine.module_state_dict: as in DeepSpeed, only save_checkpoint saves a pipeline "
                           "(here all stages in one sharded checkpoint); engine.module.state_dict() is this stage's "
                           "weights")

    def load_module_state_dict(self, checkpoint, strict: bool = True, custom_load_fn=None, fetch_z3_params: bool = False,
                               z3_params_to_fetch=None, allowed_missing_keys=None) -> None:
        """Load ``checkpoint["module"]`` (a state dict of this stage's module) into it; a pipeline checkpoint's
        directory is load_checkpoint's."""
        if custom_load_fn is not None:
            raise ValueError("load_module_state_dict: custom_load_fn is not supported with pipeline parallelism (as in "
                             "DeepSpeed)")
        if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("module"), dict):
            raise RuntimeError("PipelineEngine.load_module_state_dict: a pipeline checkpoint is loaded by "
                               "load_checkpoint; pass {'module': <this stage's state dict>} to load weights directly")
        super().load_module_state_dict(checkpoint, strict, allowed_missing_keys=allowed_missing_keys)

    def log_for_device(self, *msg) -> None:
        """A debug line tagged with this rank's stage and data-parallel index (DeepSpeed prints these only
        when its module constants are edited; here they go to the logger at DEBUG)."""
        logger.debug("RANK=%d PIPE-ID=%d DATA-ID=%d STEP-ID=%d :: %s", self.global_rank, self.stage_id,
                     self.get_data_parallel_rank(), self.global_steps, " ".join(str(m) for m in msg))

    def tput_log(self, *msg) -> None:
        """Rank 0 logs ``msg`` every ``steps_per_print`` steps."""
        if self.global_rank == 0 and self.global_steps % self.steps_per_print() == 0:
            logger.info(" ".join(str(m) for m in msg))

    def set_gradient_accumulation_boundary(self, is_boundary) -> None:
        raise RuntimeError("PipelineEngine: the schedule decides the accumulation boundary (train_batch runs "
                           "gradient_accumulation_steps micro-batches, then reduces and steps)")

    def no_sync(self):
        raise RuntimeError("PipelineEngine.no_sync: the schedule reduces the gradients once per train_batch")

    def scale(self, loss):
        raise RuntimeError("PipelineEngine.scale: the schedule runs the backward; call engine.train_batch()")

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
