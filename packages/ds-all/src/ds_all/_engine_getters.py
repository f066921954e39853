"""DeepSpeed's ``DeepSpeedEngine`` configuration getters (``fp16_enabled()``, ``zero_optimization_stage()``,
``train_micro_batch_size_per_gpu()``, ...), read from the `Config` and the parts the engine holds, and the
calls of features ds-all has not built (DeepSpeed's MoE checkpoint files, DeepCompile, AutoTP, sparse
gradients): getters that say whether such a feature is on answer False (the config refuses it on), calls
that would use it raise `NotImplementedError` naming it. A mixin of `EngineAPI` (``_engine_api.py``).
"""

from __future__ import annotations

import logging
import operator
import os
from typing import Any

import torch
from torch import nn

logger = logging.getLogger("ds_all")

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _setting(section: Any, name: str, default: Any) -> Any:
    """``section.name``, or DeepSpeed's default where ds's config has no such key (it is then at it)."""
    return getattr(section, name, default) if section is not None else default


# DeepSpeed's getters that are one config value: ``engine.<name>()`` returns the config's ``<path>`` (each is a
# method of `EngineGetters`, installed below with its name and a docstring)
CONFIG_GETTERS: dict[str, str] = {
    "use_node_local_storage": "checkpoint.use_node_local_storage",
    "load_universal_checkpoint": "checkpoint.load_universal",
    "dataloader_drop_last": "dataloader_drop_last",
    "dump_state": "dump_state",
    "gradient_predivide_factor": "gradient_predivide_factor",
    "fp16_master_weights_and_gradients": "fp16.fp16_master_weights_and_grads",
    "bf16_master_weights_and_gradients": "bf16.bf16_master_weights_and_grads",
    "bf16_optimizer_states": "bf16.bf16_optimizer_states",
    "fp16_auto_cast": "fp16.auto_cast",
    "zero_allow_untested_optimizer": "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer": "zero_force_ds_cpu_optimizer",
    "aio_config": "aio",
    "flops_profiler_enabled": "flops_profiler.enabled",
    "flops_profiler_recompute_fwd_factor": "flops_profiler.recompute_fwd_factor",
    "flops_profiler_profile_step": "flops_profiler.profile_step",
    "flops_profiler_module_depth": "flops_profiler.module_depth",
    "flops_profiler_top_modules": "flops_profiler.top_modules",
    "flops_profiler_detailed": "flops_profiler.detailed",
    "flops_profiler_output_file": "flops_profiler.output_file",
    "curriculum_enabled_legacy": "curriculum_learning.enabled",
    "pld_enabled": "progressive_layer_drop.enabled",
    "pld_theta": "progressive_layer_drop.theta",
    "pld_gamma": "progressive_layer_drop.gamma",
    "data_efficiency_enabled": "data_efficiency.enabled",
    "data_sampling_enabled": "data_efficiency.data_sampling.enabled",
    "curriculum_learning_enabled": "data_efficiency.data_sampling.curriculum_learning.enabled",
    "random_ltd_enabled": "data_efficiency.data_routing.random_ltd.enabled",
    "autotuning_enabled": "autotuning.enabled",
    "autotuning_start_profile_step": "autotuning.start_profile_step",
    "autotuning_end_profile_step": "autotuning.end_profile_step",
    "autotuning_metric": "autotuning.metric",
    "zero_reduce_scatter": "zero_optimization.reduce_scatter",
    "zero_overlap_comm": "zero_optimization.overlap_comm",
    "zero_offload_optimizer": "zero_optimization.offload_optimizer",
    "zero_offload_param": "zero_optimization.offload_param",
    "zero_sub_group_size": "zero_optimization.sub_group_size",
    "zero_reduce_bucket_size": "zero_optimization.reduce_bucket_size",
    "zero_multi_rank_bucket_allreduce": "zero_optimization.use_multi_rank_bucket_allreduce",
    "zero_allgather_bucket_size": "zero_optimization.allgather_bucket_size",
    "zero_compute_grad_norm": "zero_optimization.compute_grad_norm",
    "zero_contiguous_gradients": "zero_optimization.contiguous_gradients",
    "zero_load_from_fp32_weights": "zero_optimization.load_from_fp32_weights",
    "zero_elastic_checkpoint": "zero_optimization.elastic_checkpoint",
    "zero_max_live_parameters": "zero_optimization.max_live_parameters",
    "zero_max_reuse_distance": "zero_optimization.max_reuse_distance",
    "zero_prefetch_bucket_size": "zero_optimization.prefetch_bucket_size",
    "zero_module_granularity_threshold": "zero_optimization.module_granularity_threshold",
    "zero_param_persistence_threshold": "zero_optimization.param_persistence_threshold",
    "zero_model_persistence_threshold": "zero_optimization.model_persistence_threshold",
    "zero_gather_16bit_weights_on_model_save": "zero_optimization.gather_16bit_weights_on_model_save",
    "zero_legacy_stage1": "zero_optimization.legacy_stage1",
    "zero_ignore_unused_parameters": "zero_optimization.ignore_unused_parameters",
    "zero_save_muon_momentum_buffer_in_memory": "zero_optimization.save_muon_momentum_buffer_in_memory",
    "zero_allgather_partitions": "zero_optimization.allgather_partitions",
    "zero_round_robin_gradients": "zero_optimization.round_robin_gradients",
    "zero_parameter_alignment": "zero_optimization.parameter_alignment",
    "zero_hpz_partition_size": "zero_optimization.zero_hpz_partition_size",
    "zero_quantized_weights": "zero_optimization.zero_quantized_weights",
    "zero_quantized_nontrainable_weights": "zero_optimization.zero_quantized_nontrainable_weights",
    "zero_quantized_gradients": "zero_optimization.zero_quantized_gradients",
    "zero_log_trace_cache_warnings": "zero_optimization.log_trace_cache_warnings",
    "zero_allgather_sequential": "zero_optimization.allgather_sequential",
    "is_sanity_checks_enabled": "zero_optimization.enable_sanity_checks",
    "zenflow_config": "zero_optimization.zenflow",
}


def _config_getter(name: str, path: str) -> Any:
    get = operator.attrgetter(path)

    def getter(self: Any) -> Any:
        return get(self.config)

    getter.__name__, getter.__qualname__ = name, f"EngineGetters.{name}"
    getter.__doc__ = f"DeepSpeed's ``engine.{name}()``: the config's ``{path}``."
    return getter


def not_built(call: str, feature: str) -> NotImplementedError:
    from ._version import DS_VERSION

    return NotImplementedError(f"engine.{call}: {feature} is a DeepSpeed feature ds-all {DS_VERSION} has not built")


class EngineGetters:
    """DeepSpeed's configuration getters and the calls of features not built (see the module docstring)."""

    # --------------------------------- config getters (those that are one config value: CONFIG_GETTERS)
    def checkpoint_serialization_enabled(self) -> bool:
        return bool(_setting(self.config.checkpoint, "checkpoint_serialization", True))

    def checkpoint_writer_enabled(self) -> bool:
        return _setting(self.config.checkpoint, "writer", None) is not None

    def checkpoint_tag_validation_enabled(self) -> bool:
        return self.config.checkpoint.tag_validation != "Ignore"

    def checkpoint_tag_validation_fail(self) -> bool:
        return self.config.checkpoint.tag_validation == "Fail"

    def memory_breakdown(self) -> bool:
        return False  # refused by the config when on

    def log_level(self) -> str | None:
        return _setting(self.config, "log_level", None)

    def managed_gradient_accumulation(self) -> bool:
        return bool(_setting(self.config, "managed_gradient_accumulation", True))

    def postscale_gradients(self) -> bool:
        return not self.config.prescale_gradients

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """``(model dtype, gradient accumulation dtype)``."""
        model = torch.float16 if self.fp16_enabled() else torch.bfloat16 if self.bfloat16_enabled() else torch.float32
        accumulation = self.config.data_types.grad_accum_dtype
        return model, (model if accumulation is None else _DTYPES[accumulation])

    @staticmethod
    def is_map_style_dataset(obj: Any) -> bool:
        return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

    @staticmethod
    def is_iterable_style_dataset(obj: Any) -> bool:
        return isinstance(obj, torch.utils.data.IterableDataset)

    # precision
    def loss_scale(self) -> float:
        """The config's ``fp16.loss_scale`` (0: dynamic), as DeepSpeed's; the current scale is
        ``engine.optimizer.loss_scale``."""
        return self.config.fp16.loss_scale

    def dynamic_loss_scale(self) -> bool:
        return self.config.fp16.loss_scale == 0

    def initial_dynamic_scale(self) -> float:
        return 2 ** self.config.fp16.initial_scale_power

    def dynamic_loss_scale_args(self) -> dict[str, Any]:
        """DeepSpeed's dynamic loss scaler arguments, by its key names."""
        fp16 = self.config.fp16
        return {"init_scale": 2 ** fp16.initial_scale_power, "scale_window": fp16.loss_scale_window,
                "delayed_shift": fp16.hysteresis, "consecutive_hysteresis": fp16.consecutive_hysteresis,
                "min_scale": fp16.min_loss_scale}

    def torch_autocast_enabled(self) -> bool:
        return bool(_setting(_setting(self.config, "torch_autocast", None), "enabled", False))

    def torch_autocast_dtype(self) -> torch.dtype | None:
        name = _setting(_setting(self.config, "torch_autocast", None), "dtype", None)
        return None if name is None else _DTYPES.get(name, getattr(torch, str(name), None))

    def torch_autocast_lower_precision_safe_modules(self) -> list[str]:
        """The config's ``torch_autocast.lower_precision_safe_modules``, else DeepSpeed's default classes."""
        names = _setting(_setting(self.config, "torch_autocast", None), "lower_precision_safe_modules", None)
        if names is not None:
            return list(names)
        return [f"{c.__module__}.{c.__name__}" for c in (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)]

    # ZeRO (the zero_optimization section, ds-zero's model)
    def zero_optimization(self) -> bool:
        return self.config.zero_optimization.stage > 0

    def _zero(self, key: str) -> Any:
        return getattr(self.config.zero_optimization, key)

    def zero_use_cpu_optimizer(self) -> bool:
        offload = self._zero("offload_optimizer")
        return offload is not None and offload.device in ("cpu", "nvme")

    def zero_cpu_offload(self) -> bool:
        offload = self._zero("offload_optimizer")
        return offload is not None and offload.device == "cpu"

    def zero_partial_offload(self) -> float:
        return _setting(self._zero("offload_optimizer"), "ratio", 1.0)

    def super_offload(self) -> bool:
        return _setting(self._zero("offload_optimizer"), "super_offload", False)

    def cpuadam_cores_perc(self) -> float:
        return _setting(self._zero("offload_optimizer"), "cpuadam_cores_perc", 0.9)

    def zero_nvme_offload_optimizer(self) -> bool:
        offload = self._zero("offload_optimizer")
        return offload is not None and offload.device == "nvme"

    def zero_optimization_partition_gradients(self) -> bool:
        return self.zero_optimization_stage() >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.zero_optimization_stage() >= 3

    def is_first_weights_partition_group(self) -> bool:
        return self.zero_optimization_partition_weights()

    def swap_tensor_config(self) -> Any:
        raise NotImplementedError("engine.swap_tensor_config: DeepSpeed 0.19.8's own engine.swap_tensor_config() "
                                  "fails (its config has no swap_tensor_config); the swap settings are "
                                  "zero_offload_optimizer(), zero_offload_param() and aio_config()")

    # ds-data's sections: the legacy curriculum and progressive layer dropping (DeepSpeed's getters)
    def curriculum_params_legacy(self) -> dict[str, Any] | bool:
        """The section without ``enabled``; False when the config has no ``curriculum_learning`` (DeepSpeed's)."""
        if "curriculum_learning" not in self.config.model_fields_set:
            return False
        return self.config.curriculum_learning.params()

    def pld_params(self) -> dict[str, float] | bool:
        """``{"theta", "gamma"}``; False when the config has no ``progressive_layer_drop`` (DeepSpeed's)."""
        if "progressive_layer_drop" not in self.config.model_fields_set:
            return False
        return self.config.progressive_layer_drop.params()

    def get_pld_theta(self) -> float | None:
        """The keep ratio the next forward gets; None without progressive layer dropping."""
        return self.progressive_layer_drop.get_theta() if self.progressive_layer_drop is not None else None

    # --------------------------------------------------- features ds has not built: off, or raise
    def data_efficiency_config(self) -> dict[str, Any]:
        """The ``data_efficiency`` section as a dict, every key with its value or default (as DeepSpeed's)."""
        return self.config.data_efficiency.model_dump()

    def data_sampling_config(self) -> dict[str, Any]:
        return self.config.data_efficiency.data_sampling.model_dump()

    def curriculum_learning_config(self) -> dict[str, Any]:
        return self.config.data_efficiency.data_sampling.curriculum_learning.model_dump()

    def random_ltd_config(self) -> dict[str, Any]:
        return self.config.data_efficiency.data_routing.random_ltd.model_dump()

    def random_ltd_initialize(self) -> None:
        """Configure the model's random-LTD wrappers (`ds_data.convert_to_random_ltd` on the engine calls it)."""
        self.data_efficiency.random_ltd.initialize_layers()

    def set_data_post_process_func(self, post_process_func: Any) -> None:
        """``post_process_func(batch, data_sampler_state)`` on each batch of the training loader's data sampler
        (``data_sampling.curriculum_learning``); its ``current_difficulties`` hold the metrics' difficulties."""
        from . import _data_sampling

        _data_sampling.set_post_process(self.config, self.training_dataloader, post_process_func)

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: Any) -> None:
        """``{metric: fn(step) -> difficulty}``: the training loader's sampler schedules its ``custom`` metrics
        with them."""
        from . import _data_sampling

        _data_sampling.set_custom_schedule(self.config, self.training_dataloader, schedule_func_dict)

    def print_forward_breakdown(self, fwd_time: float) -> None:
        """The forward's time with its MoE parts, logged on rank 0: the last forward's milliseconds in the
        MoE layers, their first and second all-to-all and their gates, summed over the layers (recorded
        with ``wall_clock_breakdown``; 0 without it or without MoE layers), as DeepSpeed's."""
        moe, first, second, gate = self.moe_wiring.forward_breakdown()
        if self.global_rank == 0:
            logger.info("time (ms) | fwd: %.2f (fwd_moe: %.2f, 1st_a2a: %.2f, 2nd_a2a: %.2f, top_k: %.2f)", fwd_time,
                        moe, first, second, gate)

    # ---- autotuning (the section ds-autotune's experiments run with; ds_all/_autotuning.py profiles)
    def autotuning_profile_model_info(self) -> bool:
        info = self.config.autotuning.model_info
        return bool(self.autotuning_enabled() and info is not None and info.profile)

    def autotuning_metric_path(self) -> str:
        return self.config.autotuning.metric_path or os.path.join(os.getcwd(), "autotuning_metric.json")

    def autotuning_model_info_path(self) -> str:
        return self.config.autotuning.model_info_path or os.path.join(os.getcwd(), "autotuning_model_info.json")

    def tensor_parallel_config(self) -> Any:
        """The ``tensor_parallel`` section (`TensorParallelConfig`)."""
        return self.config.tensor_parallel

    def autotp_size(self) -> int:
        return _setting(_setting(self.config, "tensor_parallel", None), "autotp_size", 0)

    # DeepCompile and torch.compile
    def _compile_passes(self) -> list[str]:
        return list(_setting(_setting(self.config, "compile", None), "passes", None) or [])

    def compile_zero_optimization_stage(self) -> bool:
        return "z1" in self._compile_passes() or "z3" in self._compile_passes()

    def compile_autosp(self) -> bool:
        return "autosp" in self._compile_passes()

    def compile_autotp(self) -> bool:
        return "autotp" in self._compile_passes()

    def uses_parallelization_pass_only(self) -> bool:
        return self.compile_autosp() or self.compile_autotp()

    def is_deepcompile_enabled(self) -> bool:
        return bool(_setting(_setting(self.config, "compile", None), "deepcompile", False))

    def is_deepcompile_active(self) -> bool:
        return False

    @property
    def is_compiled(self) -> bool:
        return False

    def compile(self, *args: Any, **kwargs: Any) -> None:
        raise not_built("compile", "compiling the engine (torch.compile through the engine, DeepCompile); compile "
                        "the module before initialize instead")

    def get_compile_time(self) -> Any:
        raise not_built("get_compile_time", "DeepCompile")

    def register_compile_pass(self, *args: Any, **kwargs: Any) -> None:
        raise not_built("register_compile_pass", "DeepCompile")

    def get_autosp_backend(self, *args: Any, **kwargs: Any) -> Any:
        raise not_built("get_autosp_backend", "DeepCompile's AutoSP pass")

    def get_autotp_backend(self, *args: Any, **kwargs: Any) -> Any:
        raise not_built("get_autotp_backend", "DeepCompile's AutoTP pass")

    def get_deepcompile_backend(self, *args: Any, **kwargs: Any) -> Any:
        raise not_built("get_deepcompile_backend", "DeepCompile")

    def get_deepspeed_compile_backend(self, *args: Any, **kwargs: Any) -> Any:
        raise not_built("get_deepspeed_compile_backend", "DeepCompile")


for _name, _path in CONFIG_GETTERS.items():
    if _name in vars(EngineGetters):
        raise RuntimeError(f"EngineGetters.{_name} is written by hand and in CONFIG_GETTERS")
    setattr(EngineGetters, _name, _config_getter(_name, _path))
