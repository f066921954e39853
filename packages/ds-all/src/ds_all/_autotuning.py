"""The ``autotuning`` section and the engine's side of an autotuning experiment (DeepSpeed's).

When ``autotuning.enabled`` is true (ds-autotune writes it into each experiment's config), the engine
- with ``model_info.profile``: measures the model's parameters and the activation memory of one forward
  (the bytes of the leaf modules' outputs that autograd keeps), writes them to ``model_info_path``
  (``{"num_params", "trainable_num_params", "activation_mem_per_gpu", "rank", "device_type",
  "device_memory_per_gpu"}``) and exits after that first forward;
- otherwise: counts the flops of its first forward, times the optimizer steps ``start_profile_step`` + 1
  .. ``end_profile_step`` + 1 (wall clock on rank 0), writes ``metric_path`` (DeepSpeed's keys:
  ``latency`` in microseconds per step, ``throughput`` in samples per second, ``FLOPS_per_gpu``) and
  exits cleanly after step ``end_profile_step`` + 1, as DeepSpeed's engine does.
Files are written atomically (temp file + rename); the exit destroys the engine and raises SystemExit(0).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch
from ds_config import Section, write_atomic
from pydantic import Field, model_validator

import ds_comm

if TYPE_CHECKING:
    from ._train_state import TrainState

logger = logging.getLogger("ds_all")


class AutotuningModelInfo(Section):
    """``autotuning.model_info``: what the autotuner knows of the model (a profile run measures it)."""

    profile: bool = Field(False, description="This run measures the model (ds-autotune's model-info run).")
    num_params: int | None = Field(None, ge=1, description="Parameters (given: no model-info run).")
    hidden_size: int | None = Field(None, ge=1, description="Hidden size.")
    num_layers: int | None = Field(None, ge=1, description="Layers.")


class AutotuningConfig(Section):
    """DeepSpeed's ``autotuning`` section (ds-autotune searches; the engine measures one experiment)."""

    section = "autotuning"

    enabled: bool = Field(False, description="Profile this run as an autotuning experiment and exit after it.")
    fast: bool = Field(True, description="Tune only ZeRO stage and micro-batch size.")
    results_dir: str | None = Field("autotuning_results", min_length=1, description="Experiment results.")
    exps_dir: str | None = Field("autotuning_exps", min_length=1, description="Experiment descriptions.")
    overwrite: bool = Field(False, description="Rerun experiments whose results exist.")
    metric: Literal["throughput", "latency", "flops"] = Field("throughput", description="What ranks experiments.")
    start_profile_step: int = Field(3, ge=0, description="The step after which timing starts.")
    end_profile_step: int = Field(5, ge=0, description="The last step timed (the run exits after it).")
    metric_path: str | None = Field(None, description="Where the metric file is written (default: "
                                    "./autotuning_metric.json).")
    model_info_path: str | None = Field(None, description="Where the model-info file is written (default: "
                                        "./autotuning_model_info.json).")
    model_info: AutotuningModelInfo | None = Field(None, description="The model's info / the profile switch.")
    tuner_type: Literal["gridsearch", "random", "model_based"] = Field("model_based", description="Search order.")
    tuner_early_stopping: int = Field(5, ge=0, description="Experiments past the best before stopping.")
    tuner_num_trials: int = Field(50, ge=1, description="The most experiments the tuner runs.")
    arg_mappings: dict[str, str] | None = Field(None, description="Config key -> the script's option.")
    mp_size: int = Field(1, ge=1, description="Model-parallel degree.")
    max_train_batch_size: int | None = Field(None, ge=1, description="The largest global batch to try.")
    min_train_batch_size: int = Field(1, ge=1, description="The smallest global batch.")
    max_train_micro_batch_size_per_gpu: int = Field(1024, ge=1, description="The largest micro-batch to try.")
    min_train_micro_batch_size_per_gpu: int = Field(1, ge=1, description="The smallest micro-batch to try.")
    num_tuning_micro_batch_sizes: int = Field(3, ge=1, description="Micro-batch sizes to try per stage.")
    num_nodes: int | None = Field(None, ge=1, description="Nodes per experiment.")
    num_gpus: int | None = Field(None, ge=1, description="Ranks per node per experiment.")

    @model_validator(mode="after")
    def _steps(self) -> AutotuningConfig:
        if self.end_profile_step < self.start_profile_step:
            raise ValueError(f"autotuning.end_profile_step {self.end_profile_step} must not be less than "
                             f"start_profile_step {self.start_profile_step}")
        return self

    def profiles_model_info(self) -> bool:
        return self.enabled and self.model_info is not None and self.model_info.profile


def write_json_atomic(path: str, value: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomic(path, json.dumps(value))


class AutotuningProfiler:
    """The engine's part for an autotuning experiment (see the module docstring), built by the engine from its
    inputs when ``autotuning.enabled`` is true: the section, the model, the run's counters (`TrainState`, read at
    each boundary), this rank, its device and the model-parallel size, the batch sizes as callables (a script may
    change them: ``set_train_batch_size``), and ``release``, what frees the engine before the run exits. Its hooks:
    `forward` (a context around the model's forward) and `at_boundary` (after each optimizer step)."""

    def __init__(self, section: AutotuningConfig, *, module: torch.nn.Module, train_state: TrainState,
                 global_rank: int, device: torch.device, mp_world_size: int, train_batch_size: Callable[[], int],
                 gradient_accumulation_steps: Callable[[], int], release: Callable[[], None]) -> None:
        self.section, self.module, self.train_state = section, module, train_state
        self.global_rank, self.device, self.mp_world_size = global_rank, device, mp_world_size
        self.train_batch_size, self.gradient_accumulation_steps = train_batch_size, gradient_accumulation_steps
        self.release = release
        self.flops_per_forward: float | None = None
        self.start: float | None = time.perf_counter() if section.start_profile_step == 0 else None
        self.saved_bytes = 0

    @contextlib.contextmanager
    def forward(self):
        """Around the model's forward: count the saved activations (model-info run) or the first
        forward's flops (an experiment)."""
        if self.section.profiles_model_info():
            handle = torch.nn.modules.module.register_module_forward_hook(self._count_output)
            try:
                yield
            finally:
                handle.remove()
            self._write_model_info()
            return
        if self.flops_per_forward is None and self.train_state.global_steps == 0:
            from ds_profiler import FlopsProfiler

            profiler = FlopsProfiler(self.module)
            profiler.start_profile()
            try:
                yield
            finally:
                profiler.stop_profile()
                self.flops_per_forward = float(profiler.get_total_flops())
                profiler.end_profile()
            return
        yield

    def _count_output(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        """The activations a backward keeps, estimated as the outputs of the leaf modules that are part
        of the autograd graph (ZeRO-3 installs saved-tensor hooks of its own, so they are not counted)."""
        if next(module.children(), None) is not None:
            return
        for t in output if isinstance(output, (tuple, list)) else (output,):
            if torch.is_tensor(t) and t.requires_grad:
                self.saved_bytes += t.numel() * t.element_size()

    def _write_model_info(self) -> None:
        params = list(self.module.parameters())
        num = sum(int(getattr(p, "ds_numel", p.numel())) for p in params)
        trainable = sum(int(getattr(p, "ds_numel", p.numel())) for p in params if p.requires_grad)
        if self.global_rank == 0:
            device = self.device
            info = {"num_params": num * self.mp_world_size, "trainable_num_params": trainable * self.mp_world_size,
                    "activation_mem_per_gpu": self.saved_bytes, "rank": 0, "device_type": device.type,
                    "device_memory_per_gpu": _device_memory(device)}
            path = self.section.model_info_path or os.path.join(os.getcwd(), "autotuning_model_info.json")
            write_json_atomic(path, info)
            logger.info("autotuning: wrote the model info to %s: %s", path, info)
        self._exit()

    def at_boundary(self) -> None:
        """After each optimizer step: start the clock after ``start_profile_step``, and after
        ``end_profile_step`` + 1 write the metric file and exit."""
        if self.section.profiles_model_info():  # no forward went through engine.forward (a pipeline's schedule)
            self._write_model_info()
        steps = self.train_state.global_steps
        if steps == self.section.start_profile_step:
            self.start = time.perf_counter()
        if steps != self.section.end_profile_step + 1 or self.start is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - self.start
        n = self.section.end_profile_step + 1 - self.section.start_profile_step
        if self.global_rank == 0:
            latency_us = elapsed * 1e6 / n
            flops = (self.flops_per_forward or 0.0) * 3 * self.gradient_accumulation_steps()  # fwd + 2x bwd
            metrics = {"latency": latency_us, "throughput": self.train_batch_size() * 1e6 / latency_us,
                       "FLOPS_per_gpu": flops * 1e6 / latency_us, "steps": n, "rank": 0}
            path = self.section.metric_path or os.path.join(os.getcwd(), "autotuning_metric.json")
            write_json_atomic(path, metrics)
            logger.info("autotuning: wrote the metrics of steps %d-%d to %s: %s", self.section.start_profile_step + 1,
                        self.section.end_profile_step + 1, path, metrics)
        self._exit()

    def _exit(self) -> None:
        """Every rank: wait for the others, free the engine (``release``), leave the script (exit code 0)."""
        if ds_comm.is_initialized():
            ds_comm.barrier()
        self.release()
        raise SystemExit(0)


def _device_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return None
