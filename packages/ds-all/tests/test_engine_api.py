"""DeepSpeed 0.19.8's engine API on ds_all's engines: every public method and property of its
DeepSpeedEngine and PipelineEngine exists here and is in the README's table; the getters read the
config; batch-size changes, manual accumulation boundaries, no_sync, scale(), offload_states /
reload_states and load_module_state_dict train bitwise as their plain equivalents; features ds has not
built raise naming them; save_checkpoint refuses an empty directory."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ds_all
from ds_all import DeepSpeedEngine, PipelineEngine
from ds_comm.testing import spawn


def _names(text: str) -> list[str]:
    return text.split()


# deepspeed/runtime/engine.py and pipe/engine.py of DeepSpeed 0.19.8: the class's public names
DEEPSPEED_ENGINE = _names("""
aio_config all_gather_scalar allreduce_and_copy allreduce_bucket allreduce_gradients allreduce_no_retain
autotp_size autotuning_enabled autotuning_end_profile_step autotuning_metric autotuning_metric_path
autotuning_model_info_path autotuning_profile_model_info autotuning_start_profile_step backward
bf16_master_weights_and_gradients bf16_optimizer_states bfloat16_enabled buffered_allreduce_fallback
checkpoint_serialization_enabled checkpoint_tag_validation_enabled checkpoint_tag_validation_fail
checkpoint_writer_enabled clip_fp32_gradients coalesce_grad_reduction collect_python_gc
communication_data_type compile compile_autosp compile_autotp compile_zero_optimization_stage
cpuadam_cores_perc curriculum_learning_config curriculum_learning_enabled data_efficiency_config
data_efficiency_enabled data_sampling_config data_sampling_enabled dataloader_drop_last deepspeed_io destroy
dump_state dynamic_loss_scale dynamic_loss_scale_args empty_partition_cache eval flops_profiler_detailed
flops_profiler_enabled flops_profiler_module_depth flops_profiler_output_file flops_profiler_profile_step
flops_profiler_recompute_fwd_factor flops_profiler_top_modules forward fp16_auto_cast fp16_enabled
fp16_master_weights_and_gradients get_autosp_backend get_autotp_backend get_batch_info get_compile_time
get_data_parallel_rank get_data_types get_deepcompile_backend get_deepspeed_compile_backend
get_global_grad_norm get_lr get_model_parallel_rank get_mom get_optimizer_configuration
get_sequence_parallel_group get_tensor_parallel_rank get_type get_wall_clock_timers
gradient_accumulation_steps gradient_clipping gradient_predivide_factor initial_dynamic_scale is_compiled
is_deepcompile_active is_deepcompile_enabled is_first_weights_partition_group
is_gradient_accumulation_boundary is_iterable_style_dataset is_map_style_dataset is_sanity_checks_enabled
load_checkpoint load_module_state_dict load_moe_state_dict load_universal_checkpoint log_level loss_scale
managed_gradient_accumulation memory_breakdown module_state_dict no_sync offload_states
optimizer_legacy_fusion optimizer_name optimizer_params postscale_gradients print_forward_breakdown
random_ltd_config random_ltd_enabled random_ltd_initialize register_compile_pass reload_states
save_16bit_model save_checkpoint save_fp16_model scale scheduler_name scheduler_params
set_custom_curriculum_learning_schedule set_data_post_process_func set_gradient_accumulation_boundary
set_train_batch_size set_train_micro_batch_size sparse_all_gather sparse_allreduce sparse_allreduce_bucket
sparse_allreduce_no_retain step steps_per_print super_offload swap_tensor_config tensor_parallel_config
torch_autocast_dtype torch_autocast_enabled torch_autocast_lower_precision_safe_modules train train_batch_size
train_micro_batch_size_per_gpu use_node_local_storage uses_parallelization_pass_only wall_clock_breakdown
was_step_applied zenflow_config zero_allgather_bucket_size zero_allgather_partitions zero_allgather_sequential
zero_allow_untested_optimizer zero_compute_grad_norm zero_contiguous_gradients zero_cpu_offload
zero_elastic_checkpoint zero_force_ds_cpu_optimizer zero_gather_16bit_weights_on_model_save zero_grad
zero_hpz_partition_size zero_ignore_unused_parameters zero_legacy_stage1 zero_load_from_fp32_weights
zero_log_trace_cache_warnings zero_max_live_parameters zero_max_reuse_distance
zero_model_persistence_threshold zero_module_granularity_threshold zero_multi_rank_bucket_allreduce
zero_nvme_offload_optimizer zero_offload_optimizer zero_offload_param zero_optimization
zero_optimization_partition_gradients zero_optimization_partition_weights zero_optimization_stage
zero_overlap_comm zero_param_persistence_threshold zero_parameter_alignment zero_partial_offload
zero_prefetch_bucket_size zero_quantized_gradients zero_quantized_nontrainable_weights zero_quantized_weights
zero_reduce_bucket_size zero_reduce_scatter zero_round_robin_gradients
zero_save_muon_momentum_buffer_in_memory zero_sub_group_size zero_use_cpu_optimizer
""")
DEEPSPEED_PIPELINE_ENGINE = _names("""
DTYPE_TO_ID ID_TO_DTYPE backward eval_batch forward get_additional_losses get_pipeline_parallel_rank
is_first_stage is_gradient_accumulation_boundary is_last_stage load_module_state_dict log_for_device
module_state_dict reset_activation_shape set_batch_fn set_dataiterator set_dataloader set_has_attention_mask
set_train_batch_size step tput_log train_batch
""")
README = Path(__file__).resolve().parents[1] / "README.md"
IN, MICRO = 8, 4


def test_every_deepspeed_engine_name_exists():
    assert len(DEEPSPEED_ENGINE) == 180 and len(DEEPSPEED_PIPELINE_ENGINE) == 22
    assert [n for n in DEEPSPEED_ENGINE if not hasattr(DeepSpeedEngine, n)] == []
    assert [n for n in DEEPSPEED_PIPELINE_ENGINE if not hasattr(PipelineEngine, n)] == []


def test_the_readme_table_lists_every_name():
    text = README.read_text()
    section = text[text.index("### DeepSpeed's engine API"):]
    section = section[:section.index("\n#", 1)]
    listed = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)", section))
    assert sorted(set(DEEPSPEED_ENGINE + DEEPSPEED_PIPELINE_ENGINE) - listed) == []


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 1))


def _batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(MICRO, IN, generator=g), torch.randn(MICRO, 1, generator=g)


def _config(stage: int, gas: int = 2, **extra) -> dict:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
            "zero_optimization": zero, "steps_per_print": 1000, **extra}


def _engine(stage: int, gas: int = 2, **extra):
    engine, *_ = ds_all.initialize(model=_model(), config=_config(stage, gas, **extra))
    return engine


def _loss(engine, step, micro, rank):
    x, y = _batch(step, micro, rank)
    return F.mse_loss(engine(x.to(next(engine.module.parameters()).dtype)).float(), y)


def _train(engine, steps, rank, first=0):
    for step in range(first, first + steps):
        for micro in range(engine.gradient_accumulation_steps()):
            engine.backward(_loss(engine, step, micro, rank))
            engine.step()


def _weights(engine) -> list[torch.Tensor]:
    """The whole weights on every rank (at stage 3 the module's own are partitioned)."""
    return [t.clone() for t in engine.optimizer.full_state_dict(rank0_only=False).values()]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def getters_and_batch_sizes(rank, world_size, directory):
    os.chdir(directory)
    out = {}
    engine = _engine(1, gas=2, gradient_clipping=0.5, bf16={"enabled": True}, communication_data_type="fp32",
                     zero_allow_untested_optimizer=True)
    out["batch_info"] = engine.get_batch_info()
    out["zero"] = (engine.zero_optimization(), engine.zero_optimization_stage(),
                   engine.zero_optimization_partition_gradients(), engine.zero_reduce_bucket_size(),
                   engine.zero_use_cpu_optimizer(), engine.zero_partial_offload(), engine.zero_allow_untested_optimizer())
    out["precision"] = (engine.bfloat16_enabled(), engine.fp16_enabled(), engine.loss_scale(),
                        engine.dynamic_loss_scale(), engine.initial_dynamic_scale(), engine.get_data_types(),
                        engine.communication_data_type)
    out["optimizer"] = (engine.optimizer_name(), engine.optimizer_params(), engine.get_mom(), engine.scheduler_name(),
                        engine.get_type())
    out["ranks"] = (engine.get_data_parallel_rank(), engine.get_model_parallel_rank(),
                    engine.get_tensor_parallel_rank(), engine.dp_world_size, engine.mp_world_size)
    params = {"lr": 1e-3, "torch_adam": True}
    out["configuration"] = (engine.get_optimizer_configuration(params, True), params,
                            engine.get_optimizer_configuration({"lr": 1e-3}, False))
    out["off"] = (engine.curriculum_learning_enabled(), engine.autotuning_enabled(), engine.is_compiled,
                  engine.compile_autotp(), engine.memory_breakdown(), engine.managed_gradient_accumulation())
    _train(engine, 1, rank)
    with pytest.raises(ValueError, match=r"multiple of .* = 8, got 12"):
        engine.set_train_batch_size(12)
    with pytest.raises(ValueError, match="positive integer"):
        engine.set_train_micro_batch_size(0)
    engine.set_train_batch_size(24)  # micro 4 x 2 ranks x 3 accumulation steps
    out["after_set"] = engine.get_batch_info()
    boundaries = []
    for micro in range(6):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(_loss(engine, 5, micro, rank))
        engine.step()
        if micro == 0:
            with pytest.raises(RuntimeError, match="under way"):
                engine.set_train_batch_size(16)
    out["boundaries"] = boundaries
    engine.set_train_micro_batch_size(2)
    out["after_micro"] = engine.get_batch_info()
    with pytest.raises(RuntimeError, match="ZeRO's reduction buffers"):
        engine.communication_data_type = torch.bfloat16
    engine.communication_data_type = torch.float32  # the same: nothing to change
    errors = {}
    assert engine.tensor_parallel_config() is engine.config.tensor_parallel  # AutoTP's section (test_tensor_parallel)
    with pytest.raises(RuntimeError, match="no sequence parallelism"):  # sequence_parallel_size 1
        engine.get_sequence_parallel_group()
    out["autotuning"] = (engine.autotuning_metric(), engine.autotuning_start_profile_step(),
                         engine.autotuning_end_profile_step(), engine.autotuning_profile_model_info(),
                         os.path.basename(engine.autotuning_metric_path()))
    for call, args in (("compile", ()), ("sparse_allreduce", ())):
        with pytest.raises(NotImplementedError) as info:
            getattr(engine, call)(*args)
        errors[call] = str(info.value)
    out["errors"] = errors
    with pytest.raises(RuntimeError, match="curriculum_learning is off"):  # no data sampler to schedule
        engine.set_custom_curriculum_learning_schedule({})
    for bad in ("", None):
        with pytest.raises(ValueError, match="save_dir must be a directory"):
            engine.save_checkpoint(bad)
    out["cwd"] = sorted(os.listdir("."))
    engine.destroy()
    return out


def test_getters_batch_sizes_and_refusals(tmp_path):
    for out in spawn(getters_and_batch_sizes, world_size=2, args=(str(tmp_path),), timeout=180):
        assert out["batch_info"] == (16, 4, 2)
        assert out["zero"] == (True, 1, False, 500_000_000, False, 1.0, True)
        assert out["precision"] == (True, False, 0.0, True, 65536, (torch.bfloat16, torch.bfloat16), torch.float32)
        name, params, moms, scheduler, types = out["optimizer"]
        assert (name, params["lr"], moms, scheduler, types) == ("adamw", 1e-2, [(0.9, 0.999)], None, [0.0])
        assert out["ranks"][1:] == (0, 0, 2, 1)
        assert out["off"] == (False, False, False, False, False, True)
        torch_adam, params, fused = out["configuration"]
        assert torch_adam == (torch.optim.AdamW, {"foreach": None}) and params == {"lr": 1e-3}
        assert fused[0].__name__ == "FusedAdam" and fused[1] == {"adam_w_mode": False}
        assert out["after_set"] == (24, 4, 3)
        assert out["boundaries"] == [False, False, True] * 2
        assert out["after_micro"] == (12, 2, 3)
        assert out["autotuning"] == ("throughput", 3, 5, False, "autotuning_metric.json")  # the section's defaults
        for call, message in out["errors"].items():
            assert f"engine.{call}:" in message and "has not built" in message, message
        assert out["cwd"] == []  # nothing was written into the working directory


def loops_like_their_plain_equivalents(rank, world_size, stage):
    """(name, bitwise equal) for each way of driving the engine against the plain loop."""
    results = []
    plain = _engine(stage)
    _train(plain, 3, rank)
    reference = _weights(plain)
    plain.destroy()

    manual = _engine(stage)  # DeepSpeed's set_gradient_accumulation_boundary pattern
    for step in range(3):
        manual.set_gradient_accumulation_boundary(False)
        manual.backward(_loss(manual, step, 0, rank))
        manual.set_gradient_accumulation_boundary(True)
        manual.backward(_loss(manual, step, 1, rank))
        manual.step()
    results.append(("set_gradient_accumulation_boundary", _same(_weights(manual), reference)))
    manual.destroy()

    scaled = _engine(stage)  # engine.scale(loss).backward() + engine.step()
    for step in range(3):
        for micro in range(2):
            scaled.scale(_loss(scaled, step, micro, rank)).backward()
            scaled.step()
    results.append(("scale", _same(_weights(scaled), reference)))
    scaled.destroy()

    moved = _engine(stage)  # offload_states / reload_states around every micro-step
    for step in range(3):
        for micro in range(2):
            moved.offload_states()
            moved.reload_states()
            moved.backward(_loss(moved, step, micro, rank))
            moved.step()
        moved.offload_states(include=["optim_states", "lp_grads"], pin_memory=False)
        moved.reload_states()
        moved.empty_partition_cache()
    results.append(("offload_states", _same(_weights(moved), reference)))
    with pytest.raises(ValueError, match="'weights'"):
        moved.offload_states(include=["weights"])
    moved.destroy()

    if stage < 2:  # no_sync with one accumulation step, the losses halved by hand, is gas=2 counted
        synced = _engine(stage, gas=1)
        for step in range(3):
            with synced.no_sync():
                synced.backward(_loss(synced, step, 0, rank) / 2)
                with pytest.raises(RuntimeError, match="inside no_sync"):
                    synced.step()
            synced.backward(_loss(synced, step, 1, rank) / 2)
            synced.step()
        results.append(("no_sync", _same(_weights(synced), reference)))
        synced.destroy()
    else:
        refused = _engine(stage)
        with pytest.raises(RuntimeError, match="stages 0 and 1"), refused.no_sync():
            pass
        refused.destroy()
    return results


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_loops_train_like_the_plain_loop(stage):
    for results in spawn(loops_like_their_plain_equivalents, world_size=2, args=(stage,), timeout=240):
        assert [name for name, same in results if not same] == [], results
        assert len(results) == 4 if stage < 2 else 3


def module_state_round_trip(rank, world_size):
    engine = _engine(2, bf16={"enabled": True})
    _train(engine, 2, rank)
    saved = engine.module_state_dict()
    saved = {k: v.clone() for k, v in saved.items()}
    _train(engine, 2, rank, first=2)
    moved_on = not _same(list(saved.values()), [v for v in engine.module_state_dict().values()])
    engine.load_module_state_dict({"module": saved})
    for group in engine.optimizer.param_groups:  # a step that changes nothing: the master copy shows through
        group["lr"] = 0.0
        group["weight_decay"] = 0.0
    _train(engine, 1, rank, first=4)
    back = _same(list(saved.values()), list(engine.module_state_dict().values()))
    keys = sorted(engine.module_state_dict(exclude_frozen_parameters=True))  # nothing frozen: every key
    engine.destroy()
    return moved_on, back, keys


def test_load_module_state_dict_reaches_the_master_copy():
    for moved_on, back, keys in spawn(module_state_round_trip, world_size=2, timeout=180):
        assert moved_on and back
        assert keys == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"]


def pipeline_api(rank, world_size):
    from ds_pipe import LayerSpec, PipelineModule

    module = PipelineModule([LayerSpec(nn.Linear, 6, 8), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 8, 2)],
                            num_stages=2, loss_fn=F.mse_loss, partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
              "optimizer": {"type": "SGD", "params": {"lr": 0.05}}}
    engine, *_ = ds_all.initialize(model=module, config=config)

    def batches(n, rows=3):
        g = torch.Generator().manual_seed(n)
        return [(torch.randn(rows, 6, generator=g), torch.randn(rows, 2, generator=g)) for _ in range(n)]

    seen = []
    engine.set_batch_fn(lambda batch: seen.append(1) or batch)
    out = {"rank": engine.get_pipeline_parallel_rank(), "boundary": engine.is_gradient_accumulation_boundary(),
           "ids": (engine.DTYPE_TO_ID[torch.bfloat16], engine.ID_TO_DTYPE[11])}
    engine.train_batch(iter(batches(2)))
    engine.set_train_batch_size(12)  # 3 rows x 4 micro-batches (one replica)
    engine.train_batch(iter(batches(4)))
    out["micro_batches"] = (engine.micro_batches, engine.get_batch_info(), len(seen))
    engine.reset_activation_shape()  # the next batch's rows differ
    engine.train_batch(iter(batches(4, rows=5)))
    for call in ("no_sync", "module_state_dict"):
        with pytest.raises(RuntimeError):
            getattr(engine, call)()
    with pytest.raises(RuntimeError, match="decides the accumulation boundary"):
        engine.set_gradient_accumulation_boundary(False)
    engine.set_has_attention_mask(True)
    with pytest.raises(ValueError):
        engine.set_has_attention_mask("yes")
    out["losses"] = engine.get_additional_losses()
    engine.destroy()
    return out


def test_pipeline_engine_api():
    outs = spawn(pipeline_api, world_size=2, timeout=180)
    assert [out["rank"] for out in outs] == [0, 1]
    for out in outs:
        assert out["boundary"] is False and out["ids"] == (5, torch.bool)
        assert out["micro_batches"] == (4, (12, 3, 4), 2 + 4)  # batch_fn saw every micro-batch read
        assert out["losses"] is None
