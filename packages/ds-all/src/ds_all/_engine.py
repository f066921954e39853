"""`DeepSpeedEngine`: the training loop's one object, assembled from the packages' parts.

``engine(batch)`` runs the model; ``engine.backward(loss)`` and ``engine.step()`` go to a
`ds_zero.ZeroOptimizer` (stages 0-2, fp16/bf16, offload), which knows the accumulation boundary; at
each boundary the engine steps the learning-rate schedule, writes the monitors' events, prints
progress every ``steps_per_print`` steps, and runs the flops profiler at ``flops_profiler.profile_step``.
A model with ds-moe's MoE layers gets its expert groups, and its experts' parameters ZeRO groups reduced
over those groups (``_moe``).
Nothing here computes what a package below computes.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import ds_comm
from ds_profiler import FlopsProfiler
from ds_zero import ZeroInference, ZeroOptimizer

from . import (
    _checkpoint,
    _client,
    _data,
    _data_sampling,
    _deepspeed_checkpoint,
    _moe,
    _parallel,
    checkpointing,
)
from ._autocast import Autocast
from ._autotuning import AutotuningProfiler
from ._checkpoint import Checkpointer, ScheduleState
from ._data_efficiency import DataEfficiency
from ._device import engine_device, place_model
from ._engine_api import EngineAPI
from ._engine_facade import PartsFacade
from ._optimizers import ONE_BIT, build_optimizer
from ._progress import ProgressBar
from ._scheduler_config import build_scheduler
from ._timers import ALLREDUCE, BACKWARD, FORWARD, STEP, Timers
from ._train_state import RefusesPipeline, Stateful, TrainState
from .config import Config
from .monitor import Monitors

logger = logging.getLogger("ds_all")


_GC_HOLDERS = [0, True]  # engines that disabled Python's cyclic GC; whether it was enabled before the first


def _python_gc_disable() -> bool:
    """``disable_python_gc``: collect once, then no automatic cyclic collection while such an engine lives
    (``engine.collect_python_gc()`` runs one at a point the caller picks)."""
    if _GC_HOLDERS[0] == 0:
        _GC_HOLDERS[1] = gc.isenabled()
        gc.collect()
        gc.disable()
    _GC_HOLDERS[0] += 1
    return True


def _python_gc_enable() -> None:
    _GC_HOLDERS[0] -= 1
    if _GC_HOLDERS[0] == 0 and _GC_HOLDERS[1]:
        gc.enable()


class DeepSpeedEngine(PartsFacade, EngineAPI, nn.Module):
    """What `ds_all.initialize` returns first: the model (``engine.module``) with its ZeRO optimizer,
    schedule, data loader, timers, monitors and profiler. Built by `initialize`; see its docstring. The
    rest of DeepSpeed's engine API (getters, batch-size controls, offload_states, ...) is `EngineAPI`'s."""

    def __init__(self, *, model: nn.Module, config: Config, optimizer: Any = None, model_parameters: Any = None,
                 lr_scheduler: Any = None, training_data: Any = None, collate_fn: Callable | None = None,
                 mpu: Any = None, owns_process_group: bool = False) -> None:
        super().__init__()
        self.module = model
        self.config = config
        self._owns_process_group = owns_process_group
        self.world_size, self.global_rank = ds_comm.get_world_size(), ds_comm.get_rank()
        self.local_rank = ds_comm.get_local_rank()
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        if config.checkpoint.use_node_local_storage and local_world < self.world_size:
            raise NotImplementedError(
                f"checkpoint.use_node_local_storage on {self.world_size // max(local_world, 1)} nodes is not "
                "implemented in ds-all: a checkpoint's shards and its metadata are written to one shared directory "
                "(on one node, where every rank shares the storage, the key is honoured as it is)")
        # the process groups: mpu, data_parallel_group, dp_world_size, mp_world_size, the sequence-parallel ones
        self.parallel_groups = _parallel.ParallelGroups(mpu, config, model, global_rank=self.global_rank)
        # DeepSpeed's _set_distributed_vars and _configure_distributed_model: cuda:LOCAL_RANK with a GPU (the
        # current device), the model moved there before ZeRO takes it; the CPU otherwise
        self.device = engine_device(self.local_rank)
        place_model(model, self.device)
        # the parts (each from explicit inputs; DeepSpeed's attribute names forward to them, see "parts" below)
        self.train_state = TrainState()  # global_steps, global_samples, micro_steps
        self.data_efficiency = DataEfficiency(config, model)  # PLD, legacy curriculum, random-LTD, data sampler
        self.loader_position = _data.LoaderPosition()  # the training loader's ResumableSampler
        self.schedule = ScheduleState(None)  # the learning-rate schedule
        self.checkpointer: Checkpointer | None = None  # with an optimizer: save/load over the parts' states
        self.timers = Timers(device_events=config.wall_clock_breakdown)
        # before ZeRO takes the model: rank 0 alone makes the monitors, and a rank-local failure after ZeRO
        # partitioned the model would meet the others in close()'s collective (a hang, not an error)
        self.monitor = Monitors(config, rank=self.global_rank)
        self.zero: ZeroOptimizer | None = None
        self._init_api_attributes(optimizer, lr_scheduler, training_data, collate_fn)
        self.optimizer: Any = None
        one_bit = ONE_BIT.get(config.optimizer.type.lower()) \
            if config.optimizer is not None and optimizer is None else None
        if one_bit is not None and config.zero_optimization.stage != 0:
            raise ValueError(f"initialize: optimizer.type {one_bit} runs with zero_optimization.stage 0 only (as "
                             f"DeepSpeed's 1-bit optimizers), got stage {config.zero_optimization.stage}: its 1-bit "
                             "messages replace the data-parallel all-reduce that stages 1-3 partition")
        # MoE layers: has_moe_layers, num_experts, ..., the expert groups
        self.moe_wiring = _moe.MoEWiring(model, config, dp_world_size=self.dp_world_size, world_size=self.world_size)
        # sequence parallelism: ZeRO over data × sequence ranks; model parallelism: the norm over its ranks
        parallel = self.parallel_groups.zero_options()
        self.parallel_groups.prepare(self.device)  # AutoTP: the replicas made equal, the first batch checked
        zero_group = parallel.pop("group", self.parallel_groups.dp_group)
        reduce_in = parallel.pop("communication_data_type", config.communication_data_type)
        factory, groups = self._optimizer_factory(optimizer, model_parameters)
        options = {**parallel, **self._zero_options()}
        if self.has_moe_layers and factory is not None:  # each expert group's parameters over its own ranks
            factory, groups = _moe.optimizer_groups(optimizer, factory, groups,
                                                    [p for p in model.parameters() if p.requires_grad], lr_scheduler)
            options["checkpoint_names"] = _moe.checkpoint_names(model, options.get("checkpoint_names"))
        zero_config = config.zero_optimization
        if zero_config.zenflow is not None and training_data is not None:  # ZenFlow's epoch: the loader's length
            zero_config = zero_config.model_copy(update={"zenflow": type(zero_config.zenflow).model_validate(
                {**zero_config.zenflow.model_dump(), "steps_per_epoch": len(self._training_loader(training_data,
                                                                                                  collate_fn))})})
        if factory is not None:
            self.zero = self.optimizer = ZeroOptimizer(
                model, factory, config=zero_config, fp16=config.fp16, bf16=config.bf16,
                gradient_clipping=config.gradient_clipping,
                communication_data_type=reduce_in, group=zero_group,
                aio=config.aio, param_groups=groups, **options)
        # stage 3 without an optimizer (evaluation): the parameters partitioned, gathered around each module's
        # forward (DeepSpeed's DeepSpeedZeRoOffload); backward and step refuse (no optimizer)
        self._zero_inference: ZeroInference | None = None
        if factory is None and config.zero_optimization.stage == 3:
            self._zero_inference = ZeroInference(model, config=config.zero_optimization, fp16=config.fp16,
                                                 bf16=config.bf16, group=zero_group)
        try:  # what fails from here leaves no ZeRO hook on the caller's model
            self.lr_scheduler = self._scheduler(lr_scheduler)
            self.training_dataloader = self._training_loader(training_data, collate_fn) \
                if training_data is not None else None
            ds_comm.configure(config.comms_logger)
            if "activation_checkpointing" in config.model_fields_set:
                checkpointing.configure(mpu, deepspeed_config=config.activation_checkpointing)
            self.progress = ProgressBar(enabled=self.global_rank == 0,
                                        total=getattr(self.lr_scheduler, "total_num_steps", None))
        except BaseException:
            if self.zero is not None:
                self.zero.close()
            if self._zero_inference is not None:
                self._zero_inference.close()
            raise
        if self.zero is not None:
            self.checkpointer = Checkpointer(
                self.zero, states=self._checkpoint_states(), world_size=self.world_size,
                global_rank=self.global_rank, dp_world_size=self.dp_world_size,
                zero_stage=config.zero_optimization.stage, mpu=mpu, tag_validation=config.checkpoint.tag_validation,
                load_universal=config.checkpoint.load_universal)
        self.autocast = Autocast(config.torch_autocast, dtype=self.torch_autocast_dtype(), device_type=self.device.type,
                                 zero_stage=config.zero_optimization.stage)
        self._gc_disabled = _python_gc_disable() if config.disable_python_gc else False
        self.flops_profiler: FlopsProfiler | None = None
        self._profiling = False
        self._losses: torch.Tensor | None = None  # the mean loss of this accumulation (rank's own)
        self._interval_start, self._interval_steps = time.perf_counter(), 0
        self._step_applied = False
        if config.dump_state and self.global_rank == 0:
            logger.info("ds_all config:\n%s", config.model_dump_json(indent=2, exclude_defaults=True))
        # autotuning.enabled: profile this run (ds-autotune's experiment), write the metric, free the engine, exit
        self._autotuning = AutotuningProfiler(
            config.autotuning, module=model, train_state=self.train_state, global_rank=self.global_rank,
            device=self.device, mp_world_size=self.mp_world_size, train_batch_size=self.train_batch_size,
            gradient_accumulation_steps=self.gradient_accumulation_steps, release=self.destroy,
        ) if config.autotuning.enabled else None

    # ------------------------------------------------------------------------------ parts
    # the parts whose features an engine of another kind may refuse: each class's pipeline_refusal(config, module)
    # says why a PipelineEngine cannot train with the feature (None: it can); `PipelineEngine` raises the first
    FEATURE_PARTS: tuple[type[RefusesPipeline], ...] = (Autocast, DataEfficiency, _moe.MoEWiring)

    def _checkpoint_states(self) -> dict[str, Stateful]:
        """What a checkpoint holds besides ZeRO's shards: metadata key -> part (``""``: the counters, at the top
        level of format 1's ``engine_meta.json``). A new stateful feature is one entry here."""
        return {"": self.train_state, "lr_scheduler": self.schedule, "data_loader": self.loader_position,
                "data_efficiency": self.data_efficiency,
                "moe": _moe.MoELayout(self.module, log=self.global_rank == 0)}

    # ------------------------------------------------------------------------------ construction
    def _training_loader(self, training_data: Any, collate_fn: Callable | None):
        """The loader of ``initialize(training_data=...)``: DeepSpeed's ``deepspeed_io`` (shuffled)."""
        return self.deepspeed_io(training_data, collate_fn=collate_fn)

    def _zero_options(self) -> dict[str, Any]:
        """How ZeRO reduces: in its backward hooks, one micro-step per ``backward``/``step`` pair."""
        return {"gradient_accumulation_steps": self.config.gradient_accumulation_steps}

    def _optimizer_factory(self, optimizer: Any, model_parameters: Any) -> tuple[Callable | None, Any]:
        """How ZeRO builds the optimizer over its flat tensors (the client's optimizer rebound to them, a
        client callable, or the config's ``optimizer`` section; None when there is none), and the
        parameter groups with options of their own ZeRO is given (None: one group). The factory is
        called with the groups over ZeRO's tensors when there are groups, else with the tensors."""
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        groups = None
        if model_parameters is not None:
            groups = _client.model_parameter_groups(model_parameters, trainable)
        if optimizer is not None and self.config.optimizer is not None and self.global_rank == 0 and \
                (isinstance(optimizer, torch.optim.Optimizer) or callable(optimizer)):
            # DeepSpeed's _configure_optimizer: the client's optimizer overrides the config's section
            logger.warning("initialize: using the optimizer passed (%s) rather than the config's 'optimizer' "
                           "section (type %r)", getattr(optimizer, "__name__", type(optimizer).__name__),
                           self.config.optimizer.type)
        if isinstance(optimizer, torch.optim.Optimizer):
            return _client.rebinder(optimizer, trainable)
        if optimizer is not None:
            if not callable(optimizer):
                raise ValueError(f"initialize: optimizer must be a torch.optim.Optimizer or a callable taking the "
                                 f"parameters, got {type(optimizer).__name__}")
            return optimizer, groups
        if self.config.optimizer is None:
            return None, None
        offload = self.config.zero_optimization.offload_optimizer is not None and \
            self.config.zero_optimization.offload_optimizer.device == "cpu"
        section = self.config.optimizer
        bf16_states = bool(self.config.bf16.enabled is True and self.config.bf16.bf16_optimizer_states)
        return (lambda params: build_optimizer(section, params, offload=offload, bf16_states=bf16_states)), groups

    def _scheduler(self, lr_scheduler: Any) -> Any:
        if lr_scheduler is not None and self.config.scheduler.type is not None and self.global_rank == 0:
            # DeepSpeed's _configure_lr_scheduler: the client's schedule overrides the config's section
            logger.warning("initialize: using the lr_scheduler passed (%s) rather than the config's 'scheduler' "
                           "section (type %r)", getattr(lr_scheduler, "__name__", type(lr_scheduler).__name__),
                           self.config.scheduler.type)
        if self.optimizer is None:
            if lr_scheduler is not None or self.config.scheduler.type is not None:
                raise ValueError("initialize: a learning-rate schedule needs an optimizer (pass optimizer= or give "
                                 "the config an 'optimizer' section)")
            return None
        if lr_scheduler is None:
            return build_scheduler(self.config.scheduler, self.optimizer.optimizer)
        if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            return lr_scheduler(self.optimizer.optimizer)
        return lr_scheduler

    def deepspeed_io(self, dataset: Any, batch_size: int | None = None, route: Any = "train", pin_memory: bool = True,
                     data_sampler: Any = None, collate_fn: Callable | None = None,
                     num_local_io_workers: int | None = None) -> torch.utils.data.DataLoader:
        """A data loader of ``dataset`` for this data-parallel rank: micro-batches of
        ``train_micro_batch_size_per_gpu`` from a `DistributedSampler` over the data-parallel ranks
        (shuffled for ``route="train"``, in order for "eval" and "predict", as DeepSpeed's); with
        ``data_efficiency.data_sampling.curriculum_learning`` on and no ``data_sampler``, a training loader
        draws by difficulty (`ds_data.DataSampler`, see ``_data_sampling``)."""
        routes = ("train", "eval", "predict", "encode")
        if route not in routes:
            raise ValueError(f"deepspeed_io: route must be one of {', '.join(repr(r) for r in routes)}, got {route!r}")
        if data_sampler is None and route in ("train", "encode") and _data_sampling.enabled(self.config):
            return _data_sampling.loader(self.config, dataset, batch_size=batch_size,
                                         dp_rank=ds_comm.get_rank(self.data_parallel_group),
                                         dp_world_size=self.dp_world_size, global_rank=self.global_rank,
                                         pin_memory=pin_memory, collate_fn=collate_fn)
        return self._loader(dataset, batch_size, pin_memory, data_sampler, collate_fn, num_local_io_workers,
                            shuffle=route not in ("eval", "predict"))

    def _loader(self, dataset: Any, batch_size: int | None, pin_memory: bool, data_sampler: Any,
                collate_fn: Callable | None, num_local_io_workers: int | None, *, shuffle: bool):
        return _data.loader(dataset, batch_size=batch_size or self.train_micro_batch_size_per_gpu(),
                            num_replicas=self.dp_world_size, rank=ds_comm.get_rank(self.data_parallel_group),
                            drop_last=self.config.dataloader_drop_last, pin_memory=pin_memory,
                            data_sampler=data_sampler, collate_fn=collate_fn,
                            num_workers=num_local_io_workers or 0, shuffle=shuffle)

    # ----------------------------------------------------------------------------- the loop
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """The model's forward, timed; at ``flops_profiler.profile_step`` its first forward starts
        the profile (rank 0). In training, ``progressive_layer_drop`` adds ``progressive_layer_drop=True,
        pld_theta=θ`` and ``curriculum_learning`` ``curriculum_seqlen=<difficulty>`` to the keyword arguments."""
        if self.module.training:
            kwargs = self.data_efficiency.forward_kwargs(kwargs, global_steps=self.train_state.global_steps)
        if self._should_profile():
            self.flops_profiler = FlopsProfiler(self.module, ds_engine=self,
                                                recompute_fwd_factor=self.config.flops_profiler.recompute_fwd_factor)
            self.flops_profiler.start_profile()
            self._profiling = True
        self.timers(FORWARD).start()
        try:
            with self.autocast.context(), (self._autotuning.forward() if self._autotuning else contextlib.nullcontext()):
                return self.module(*inputs, **kwargs)
        finally:
            self.timers(FORWARD).stop()
            if self._profiling:
                self.flops_profiler.stop_profile()

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss`` through ZeRO (divided by the accumulation steps, times the fp16 loss
        scale; gradients reduced as they are produced). Returns the loss divided by the accumulation
        steps (``scale_wrt_gas``), as DeepSpeed's does."""
        zero = self._require_optimizer("backward")
        if torch.is_tensor(loss) and loss.numel() == 1:
            piece = loss.detach().float() / self.gradient_accumulation_steps()
            self._losses = piece if self._losses is None else self._losses + piece
        self.timers(BACKWARD).start()
        try:
            zero.backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)
        finally:
            self.timers(BACKWARD).stop()
        return loss / self.gradient_accumulation_steps() if scale_wrt_gas else loss

    def step(self) -> None:
        """One micro-step: at the accumulation boundary the optimizer steps (skipped on fp16
        overflow), gradients are zeroed, the schedule steps, monitors and progress are written."""
        zero = self._require_optimizer("step")
        if self.inside_no_sync_ctxt:
            raise RuntimeError("engine.step: inside no_sync, gradients are not reduced; step after the block")
        boundary = zero.is_gradient_accumulation_boundary
        self.timers(STEP).start()
        waited = zero.reduction_wait_s
        try:
            applied = zero.step()
            if boundary:
                zero.zero_grad()
        finally:
            self.timers(STEP).stop()
            self.timers(ALLREDUCE).add(zero.reduction_wait_s - waited)
        counters = self.train_state
        counters.micro_steps += 1
        counters.global_samples += self.train_micro_batch_size_per_gpu() * self.dp_world_size
        if not boundary:
            if self.config.zero_optimization.zenflow is not None and self.lr_scheduler is not None:
                self.lr_scheduler.step()  # DeepSpeed's ZenFlow steps the schedule at every micro-step
            return
        self._step_applied = applied
        if applied and self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.data_efficiency.at_boundary(counters.global_steps)  # PLD's theta from the steps before (DeepSpeed's order)
        counters.global_steps += 1
        self._interval_steps += 1
        self._after_boundary()

    def _after_boundary(self) -> None:
        loss = float(self._losses) if self._losses is not None else None
        self._losses = None
        if self._profiling:
            self._print_profile()
        if self.monitor.enabled:
            events = [("Train/Samples/lr", self.get_lr()[0], self.global_samples)]
            if loss is not None:
                events.append(("Train/Samples/train_loss", loss, self.global_samples))
            if self.fp16_enabled():
                events.append(("Train/Samples/loss_scale", self.zero.loss_scale, self.global_samples))
            if self.get_global_grad_norm() is not None:
                events.append(("Train/Samples/grad_norm", self.get_global_grad_norm(), self.global_samples))
            elapsed = time.perf_counter() - self._interval_start
            if self._interval_steps and elapsed > 0:
                rate = self._interval_steps * self.train_batch_size() / elapsed
                events.append(("Train/Samples/samples_per_sec", rate, self.global_samples))
            self.monitor.write_events(events)
        self.progress.update(self.global_steps, loss, self.get_lr())
        if self.global_steps % self.config.steps_per_print == 0:
            with self.progress.writing():
                self._print_progress(loss)
        if self._autotuning is not None:
            self._autotuning.at_boundary()

    def _print_progress(self, loss: float | None) -> None:
        elapsed = time.perf_counter() - self._interval_start
        rate = self._interval_steps * self.train_batch_size() / elapsed if elapsed > 0 else 0.0
        if self.global_rank == 0:
            lrs = ", ".join(f"{lr:.6g}" for lr in self.get_lr())
            logger.info("step=%d, skipped=%d, lr=[%s], loss=%s, samples/sec=%.1f", self.global_steps,
                        self.skipped_steps, lrs, "-" if loss is None else f"{loss:.5f}", rate)
            if self.wall_clock_breakdown():
                if self.has_moe_layers:
                    self.print_forward_breakdown(self.timers(FORWARD).elapsed(reset=False) / max(self._interval_steps, 1))
                logger.info(self.timers.line([FORWARD, BACKWARD, STEP, ALLREDUCE], self._interval_steps))
        self._interval_start, self._interval_steps = time.perf_counter(), 0

    def _should_profile(self) -> bool:
        section = self.config.flops_profiler
        return (section.enabled and self.global_rank == 0 and not self._profiling and self.flops_profiler is None
                and self.global_steps == section.profile_step)

    def _print_profile(self) -> None:
        options = self.config.flops_profiler.print_options()
        self.flops_profiler.print_model_profile(**options)
        self.flops_profiler.end_profile()
        self._profiling = False

    def _require_optimizer(self, call: str) -> ZeroOptimizer:
        if self.zero is None:
            raise RuntimeError(f"engine.{call}: this engine has no optimizer (pass optimizer= to initialize or "
                               "give the config an 'optimizer' section)")
        return self.zero

    def zero_grad(self) -> None:
        """Zero the gradients (``step`` does it at each boundary already)."""
        if self.zero is not None:
            self.zero.zero_grad()

    # ------------------------------------------------------------------------------ state
    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-step's ``step()`` updates the model."""
        return self.zero.is_gradient_accumulation_boundary if self.zero is not None else True

    def was_step_applied(self) -> bool:
        """Whether the last boundary's optimizer step was applied (False after an fp16 overflow)."""
        return self._step_applied

    def get_lr(self) -> list[float]:
        return [float(group["lr"]) for group in self.optimizer.param_groups] if self.optimizer is not None else []

    def get_global_grad_norm(self) -> float | None:
        return self.zero.get_global_grad_norm() if self.zero is not None else None

    @property
    def skipped_steps(self) -> int:
        return self.zero.skipped_steps if self.zero is not None else 0

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled is True

    def bf16_enabled(self) -> bool:
        return self.config.bf16.enabled is True

    def bfloat16_enabled(self) -> bool:
        """DeepSpeed's name of `bf16_enabled`."""
        return self.bf16_enabled()

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    def steps_per_print(self) -> int:
        return self.config.steps_per_print

    # ---------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, save_dir: Any, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False,
                        async_save: bool = False) -> bool:
        """Save everything this run needs to continue exactly under ``save_dir/tag`` (default
        ``global_step<N>``) and name it in ``save_dir/latest``; every rank calls it. Written under a
        temporary name and renamed into place: an interrupted save never replaces a complete one.
        ``client_state``: JSON values and tensors, returned by `load_checkpoint`. ``async_save``: copy
        what is saved, return, and write in the background (`wait_checkpoint`)."""
        _checkpoint.check_directory(save_dir, "save_checkpoint", "save_dir")
        self._require_optimizer("save_checkpoint")
        return self.checkpointer.save(save_dir, tag if tag is not None else f"global_step{self.global_steps}",
                                      client_state, save_latest, exclude_frozen_parameters, async_save)

    def wait_checkpoint(self) -> None:
        """Wait for a ``save_checkpoint(..., async_save=True)`` still writing (every rank calls it; a
        save, a load and `destroy` wait too). Its error, if it failed, is raised here."""
        if self.checkpointer is not None:
            self.checkpointer.wait()

    def load_checkpoint(self, load_dir: Any, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[str | None, dict | None]:
        """Load ``load_dir/tag`` (default: the tag ``latest`` names), saved on any world size and ZeRO
        stage; returns ``(path, client_state)``, or ``(None, None)`` when there is nothing to load."""
        zero = self._require_optimizer("load_checkpoint")

        def load_deepspeed(path: Any) -> tuple[str, dict]:  # a tag directory DeepSpeed wrote
            return _deepspeed_checkpoint.load_deepspeed(
                zero, path, train_state=self.train_state, lr_scheduler=self.lr_scheduler,
                train_batch_size=self.train_batch_size(), gradient_accumulation_steps=self.gradient_accumulation_steps(),
                load_module_strict=load_module_strict, load_optimizer_states=load_optimizer_states,
                load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only)

        return self.checkpointer.load(load_dir, tag, load_module_strict, load_optimizer_states,
                                      load_lr_scheduler_states, load_module_only, load_deepspeed)

    def save_16bit_model(self, save_dir: Any, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """The model's weights, whole, in their training dtype (16-bit with fp16/bf16), as one
        ``torch.save`` file written by rank 0 (every rank calls it: at stage 3 the weights are gathered
        one module at a time). At stage 3 this needs ``stage3_gather_16bit_weights_on_model_save``;
        without it nothing is written and False is returned (DeepSpeed's behaviour), with a warning."""
        zero = self.config.zero_optimization
        _checkpoint.check_directory(save_dir, "save_16bit_model", "save_dir")
        if zero.stage == 3 and not zero.gather_16bit_weights_on_model_save:
            logger.warning("save_16bit_model: nothing saved: at stage 3 the weights are partitioned, and "
                           "zero_optimization.stage3_gather_16bit_weights_on_model_save is false (set it true to "
                           "gather them on rank 0 when saving)")
            return False
        partitioned = self.zero if self.zero is not None else self._zero_inference
        sliced = self.parallel_groups.consolidated_state_dict()  # tensor parallelism: AutoTP's slices gathered
        if sliced is not None:
            state = sliced
        elif partitioned is not None:
            state = partitioned.full_state_dict()
        else:
            state = {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()} \
                if self.global_rank == 0 else {}
        if exclude_frozen_parameters:
            frozen = {name for name, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        state = {k: v.cpu() if torch.is_tensor(v) else v for k, v in state.items()}  # the file: CPU tensors
        if self.global_rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            path = os.path.join(save_dir, save_filename)
            torch.save(state, path + ".tmp")
            os.replace(path + ".tmp", path)  # never a torn file under the name
        ds_comm.barrier()
        return True

    save_fp16_model = save_16bit_model  # DeepSpeed's older name

    # ----------------------------------------------------------------------------- lifecycle
    def destroy(self) -> None:
        """Free what the engine holds: ZeRO's hooks and buffers, the monitors' files, the profiler,
        and the process group when `initialize` created it. The engine cannot train afterwards."""
        if self.zero is not None:
            self.wait_checkpoint()
            self.zero.close()
        if self._zero_inference is not None:  # every parameter whole again (a collective)
            self._zero_inference.close()
            self._zero_inference = None
        if self.checkpointer is not None:
            self.checkpointer.close()
        self.zero = self.optimizer = self.lr_scheduler = self.training_dataloader = None
        if self.flops_profiler is not None:
            self.flops_profiler.end_profile()
            self.flops_profiler = None
        self.monitor.close()
        self.progress.close()
        if self._owns_process_group and ds_comm.is_initialized():
            ds_comm.destroy_process_group()
            _moe.forget_expert_groups()  # they went with it; a later initialize makes its own
            # dead handles; held, they would keep the group's store serving on MASTER_PORT and its gloo
            # threads running for as long as the caller names this engine (into the next initialize)
            self.parallel_groups.release()
        self._owns_process_group = False
        if self._gc_disabled:
            _python_gc_enable()
            self._gc_disabled = False
        from .utils import groups

        groups.mpu = None  # as DeepSpeed's destroy: the next initialize registers its own
