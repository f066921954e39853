"""The one table of DeepSpeed's module paths in ds-all: DeepSpeed path (below ``deepspeed``) -> what the module
at ``ds_all.<path>`` holds, and whose object each name is.

Most modules at DeepSpeed's paths only re-export objects their owning package builds: they are GENERATED from
this table (``python -m ds_all._compat_gen`` writes them; ``tests/test_deepspeed_names_table.py`` fails when a
file differs from what the table gives, so edit the table, never the files). The modules with code of their
own are ``hand=True``: written by hand, listed here with the names they provide so that the same tests cover
them. ``tests/fixtures/deepspeed_module_tree.json`` is DeepSpeed 0.19.8's module tree: every path here is one of
its modules (or, for ``zero`` and ``checkpointing``, a module-valued attribute of ``deepspeed``) unless it says
why it is ``legacy``, and every name one of that module's names unless listed in ``extra`` (ds's additions).

An owner is ``"package.module:attribute"``, or ``"package.module"`` for a module object.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Module:
    doc: str | None
    """The module's docstring (None for a hand-written module, whose file keeps its own)."""
    names: dict[str, str] = field(default_factory=dict)
    """name -> owner: ``from owner import attribute as name`` (the object identity the path test checks)."""
    star: str | None = None
    """Every public name of this owner module (``from owner import *`` and its ``__all__``)."""
    submodules: str = ""
    """Submodules imported (space-separated), so that ``deepspeed.x.y`` is an attribute as in DeepSpeed."""
    constants: dict[str, str] = field(default_factory=dict)
    """DeepSpeed's module-level string constants."""
    refused: tuple[str, str] | None = None
    """(space-separated names, what they are): DeepSpeed's names ds has not built, an ImportError naming them."""
    hand: bool = False
    """A module with code of its own, not generated."""
    provides: str = ""
    """A hand-written module's own names (space-separated) at this path."""
    legacy: str = ""
    """Why ds keeps a path DeepSpeed 0.19.8 no longer has (scripts written against an earlier DeepSpeed)."""
    extra: str = ""
    """Names of ``names``/``provides``/``constants`` that DeepSpeed's module does not have (ds's additions)."""


def _of(owner: str, names: str) -> dict[str, str]:
    return {name: f"{owner}:{name}" for name in names.split()}


# DeepSpeed's state-access functions (deepspeed.utils and deepspeed.utils.tensor_fragment), ds-zero's
SAFE_FUNCTIONS = ("safe_get_full_fp32_param safe_get_full_grad safe_get_full_optimizer_state "
                  "safe_get_local_fp32_param safe_get_local_grad safe_get_local_optimizer_state "
                  "safe_set_full_fp32_param safe_set_full_grad safe_set_full_optimizer_state "
                  "safe_set_local_fp32_param safe_set_local_grad safe_set_local_optimizer_state "
                  "safe_update_full_grad_vectorized")

DEEPSPEED: dict[str, Module] = {
    "accelerator": Module(
        """DeepSpeed's ``deepspeed.accelerator``: ``from ds_all.accelerator import get_accelerator`` (ds-ops' seam).""",
        names=_of("ds_ops", "SUPPORTED_ACCELERATOR_LIST Accelerator get_accelerator is_current_accelerator_supported set_accelerator"),
        extra="Accelerator SUPPORTED_ACCELERATOR_LIST"),
    "autotuning": Module(
        """DeepSpeed's ``deepspeed.autotuning``: the autotuner (ds-autotune's) at DeepSpeed's paths: ``autotuner``
(``Autotuner(args, active_resources)``), ``scheduler`` (``ResourceManager``) and ``utils``
(``get_val_by_key``, ``set_val_by_key``).""",
        names=_of("ds_all.autotuning.autotuner", "Autotuner"),
        submodules="scheduler utils"),
    "autotuning.scheduler": Module(
        """DeepSpeed's ``deepspeed.autotuning.scheduler``: ``ResourceManager(args, hosts, num_gpus_per_node,
results_dir, exps_dir, arg_mappings)``, ds-autotune's (the hosts and slots experiments use, the arg mappings
their commands apply).""",
        names=_of("ds_autotune", "ResourceManager")),
    "autotuning.utils": Module(
        """DeepSpeed's ``deepspeed.autotuning.utils``: ``get_val_by_key`` and ``set_val_by_key`` (a key at any depth
of a nested config), ds-autotune's.""",
        names=_of("ds_autotune", "get_val_by_key set_val_by_key")),
    "checkpoint": Module(
        """DeepSpeed's ``deepspeed.checkpoint`` paths that training libraries import: ``checkpoint.utils``
(``clone_tensors_for_torch_save``, which Accelerate calls on a gathered ZeRO-3 state dict).""",
        submodules="utils"),
    "elasticity": Module(
        """DeepSpeed's ``deepspeed.elasticity``: the elastic batch-size computation (ds-launch's, standard library
only), its errors, and the ``elasticity`` section's model. ``ds_all.elasticity.config`` is DeepSpeed's
``deepspeed.elasticity.config`` (where DeepSpeed's scripts and tests find the errors).""",
        legacy="DeepSpeed's elasticity package, which 0.19.8 no longer ships; the engine and ds-launch keep the elastic batch computation",
        names=_of("ds_launch", "ElasticityConfigError ElasticityError ElasticityIncompatibleWorldSize compute_elastic_config") | _of("ds_all._elasticity", "ElasticityConfig elasticity_enabled"),
        submodules="config"),
    "elasticity.config": Module(
        """DeepSpeed's ``deepspeed.elasticity.config``: the elasticity errors and the section's model.""",
        legacy="DeepSpeed's elasticity package, which 0.19.8 no longer ships",
        names=_of("ds_launch", "ElasticityConfigError ElasticityError ElasticityIncompatibleWorldSize") | _of("ds_all._elasticity", "ElasticityConfig")),
    "launcher": Module(
        """DeepSpeed's ``deepspeed.launcher``: its ``runner`` module (``parse_args``, ``main``) over ds-launch.""",
        names={"runner": "ds_all.launcher.runner"}),
    "module_inject": Module(
        """DeepSpeed's ``deepspeed.module_inject``: AutoTP's layers and shard sizes (``layers``, ``tp_shard``),
ds-parallel's under DeepSpeed's module paths, and the AutoTP mode switch.""",
        names=_of("ds_all.module_inject.layers", "get_auto_tp_mode is_autotp_training_mode set_autotp_mode"),
        submodules="layers tp_shard",
        extra="get_auto_tp_mode is_autotp_training_mode"),
    "moe": Module(
        """DeepSpeed's ``deepspeed.moe``: ds-moe's Mixture of Experts under DeepSpeed's module paths
(``from ds_all.moe.layer import MoE``, ``ds_all.moe.sharded_moe``, ``ds_all.moe.experts``, ``ds_all.moe.utils``).""",
        submodules="experts layer sharded_moe utils"),
    "moe.experts": Module(
        """DeepSpeed's ``deepspeed.moe.experts``: ds-moe's `Experts`.""",
        names=_of("ds_moe", "Experts")),
    "moe.layer": Module(
        """DeepSpeed's ``deepspeed.moe.layer``: ds-moe's `MoE`.""",
        names=_of("ds_moe", "MoE")),
    "moe.sharded_moe": Module(
        """DeepSpeed's ``deepspeed.moe.sharded_moe``: ds-moe's gate (`TopKGate`, the gating functions, the noise
functions), `MOELayer`, and the module-level names DeepSpeed's own tests reach:

* ``_route_slots``, ``_sparse_encode``, ``_sparse_decode``: ds-moe's `route_slots`, `sparse_encode`,
  `sparse_decode` (the sparse dispatch `MOELayer` runs), with DeepSpeed's signatures and results.
* ``_AllToAll``: ds-moe's `AllToAll`, the same class object `MOELayer` sends tokens through, so patching
  ``_AllToAll.apply`` here changes (or counts) the layer's all-to-alls.
* ``dist``: the communication module the gating functions call (``ds_comm``, whose public names are
  ``deepspeed.comm``'s), so patching ``dist.all_reduce`` here changes (or counts) the dropless capacity's
  all-reduce over the expert-parallel group.
""",
        names=_of("ds_moe", "MOELayer TopKGate gumbel_rsample multiplicative_jitter top1gating top2gating topkgating") | {"dist": "ds_comm", "_AllToAll": "ds_moe:AllToAll", "_route_slots": "ds_moe:route_slots", "_sparse_encode": "ds_moe:sparse_encode", "_sparse_decode": "ds_moe:sparse_decode"}),
    "moe.utils": Module(
        """DeepSpeed's ``deepspeed.moe.utils``: ds-moe's parameter utilities.""",
        names=_of("ds_moe", "configure_moe_param_groups has_moe_layers is_moe_param is_moe_param_group split_params_grads_into_shared_and_expert_params split_params_into_different_moe_groups_for_optimizer split_params_into_shared_and_expert_params")),
    "ops.adagrad": Module(
        """DeepSpeed's ``deepspeed.ops.adagrad``.""",
        names={"DeepSpeedCPUAdagrad": "ds_ops:CPUAdagrad"}),
    "ops.adam": Module(
        """DeepSpeed's ``deepspeed.ops.adam``.""",
        names=_of("ds_ops", "FusedAdam") | {"DeepSpeedCPUAdam": "ds_ops:CPUAdam"}),
    "ops.lamb": Module(
        """DeepSpeed's ``deepspeed.ops.lamb``.""",
        names=_of("ds_ops", "FusedLamb")),
    "ops.lion": Module(
        """DeepSpeed's ``deepspeed.ops.lion``.""",
        names={"DeepSpeedCPULion": "ds_ops:CPULion"}),
    "ops.op_builder": Module(
        """DeepSpeed's ``deepspeed.ops.op_builder`` is ds-ops' builder (``CPUAdamBuilder().load()`` ...).""",
        star="ds_ops.op_builder"),
    "ops.sparse_attention": Module(
        """DeepSpeed's ``deepspeed.ops.sparse_attention`` is ds-ops' block-sparse attention.""",
        legacy="DeepSpeed's block-sparse attention, which 0.19.8 no longer ships (ds-ops keeps it)",
        star="ds_ops.sparse_attention"),
    "pipe": Module(
        """``ds_all.pipe`` is ds-pipe (DeepSpeed's ``deepspeed.pipe``): ``from ds_all.pipe import PipelineModule, LayerSpec``.""",
        star="ds_pipe"),
    "runtime": Module(
        """DeepSpeed's ``deepspeed.runtime`` paths that scripts import, each an alias of the part that owns it.""",
        submodules="activation_checkpointing bf16_optimizer data_pipeline dataloader engine fp16 lr_schedules pipe progressive_layer_drop utils zero",
        extra="progressive_layer_drop"),
    "runtime.activation_checkpointing": Module(
        """DeepSpeed's ``deepspeed.runtime.activation_checkpointing``: its ``checkpointing`` is ``ds_all.checkpointing``.""",
        submodules="checkpointing"),
    "runtime.activation_checkpointing.checkpointing": Module(
        """DeepSpeed's ``deepspeed.runtime.activation_checkpointing.checkpointing`` is ``ds_all.checkpointing``.""",
        names=_of("ds_all.checkpointing", "checkpoint configure get_cuda_rng_tracker is_configured model_parallel_cuda_manual_seed reset")),
    "runtime.bf16_optimizer": Module(
        """DeepSpeed's ``deepspeed.runtime.bf16_optimizer``. DeepSpeed trains bf16 at ZeRO stage 0 with its
``BF16_Optimizer`` and at stages 1-3 with its ZeRO optimizers; ds trains bf16 at every stage with
`ds_zero.ZeroOptimizer` (a float32 master copy unless ``bf16_master_weights_and_grads``), so
``BF16_Optimizer`` is that class: ``isinstance(engine.optimizer, BF16_Optimizer)`` holds for a bf16
engine at any stage (and for any ZeRO engine of ds, fp16 and float32 ones included).""",
        names={"BF16_Optimizer": "ds_zero:ZeroOptimizer"}),
    "runtime.data_pipeline.curriculum_scheduler": Module(
        """DeepSpeed's ``deepspeed.runtime.data_pipeline.curriculum_scheduler`` is ds-data's `CurriculumScheduler`.""",
        names=_of("ds_data", "CurriculumScheduler")),
    "runtime.data_pipeline.data_routing": Module(
        """DeepSpeed's ``deepspeed.runtime.data_pipeline.data_routing`` (random-LTD): ds-data's objects at its paths."""),
    "runtime.data_pipeline.data_routing.basic_layer": Module(
        """DeepSpeed's ``deepspeed.runtime.data_pipeline.data_routing.basic_layer`` is ds-data's `RandomLayerTokenDrop`.""",
        names=_of("ds_data", "RandomLayerTokenDrop")),
    "runtime.data_pipeline.data_routing.helper": Module(
        """DeepSpeed's ``deepspeed.runtime.data_pipeline.data_routing.helper``: ds-data's `convert_to_random_ltd`.
``save_without_random_ltd`` and ``remove_random_ltd_state_dict`` are not built (ds-all saves a converted model's
own keys); importing them is an ImportError naming them.""",
        names=_of("ds_data", "convert_to_random_ltd"),
        refused=("save_without_random_ltd remove_random_ltd_state_dict", "the state dict of a random-LTD model without its wrappers' names")),
    "runtime.data_pipeline.data_routing.scheduler": Module(
        """DeepSpeed's ``deepspeed.runtime.data_pipeline.data_routing.scheduler`` is ds-data's `RandomLTDScheduler`
(``BaseScheduler``, its base class in DeepSpeed, is not built: an ImportError naming it).""",
        names=_of("ds_data", "RandomLTDScheduler"),
        refused=("BaseScheduler", "the base class of DeepSpeed's random-LTD scheduler")),
    "runtime.data_pipeline.data_routing.utils": Module(
        """DeepSpeed's ``deepspeed.runtime.data_pipeline.data_routing.utils``: its gather/scatter helpers are not built
(ds-data's `RandomLayerTokenDrop` gathers and scatters the kept tokens itself); importing them is an ImportError
naming them.""",
        refused=("bsh_decoder_gather bsh_decoder_scatter", "random-LTD's batch-sequence-hidden gather and scatter helpers")),
    "runtime.data_pipeline.data_sampling": Module(
        """DeepSpeed's ``deepspeed.runtime.data_pipeline.data_sampling``: ds-data's analyzer, sampler and indexed
dataset at its paths; ``variable_batch_size_and_lr`` is not wired into ds-all yet (an ImportError naming it)."""),
    "runtime.data_pipeline.data_sampling.data_analyzer": Module(
        """DeepSpeed's ``deepspeed.runtime.data_pipeline.data_sampling.data_analyzer`` is ds-data's `DataAnalyzer`
(``DistributedDataAnalyzer``, ``Dist`` and ``test_compare_both_data_analyzers`` are not built: ImportErrors
naming them; run ``DataAnalyzer.run_map`` on each worker, then ``run_reduce`` once).""",
        names=_of("ds_data", "DataAnalyzer"),
        refused=("DistributedDataAnalyzer Dist test_compare_both_data_analyzers", 'the data analyzer over torch.distributed')),
    "runtime.data_pipeline.data_sampling.data_sampler": Module(
        """DeepSpeed's ``deepspeed.runtime.data_pipeline.data_sampling.data_sampler``: ``DeepSpeedDataSampler`` is
ds-data's `DataSampler` (its own signature: ``DataSampler(total_samples, num_epochs, micro_batch_size,
data_parallel_rank, data_parallel_size, ...)``, not DeepSpeed's data-efficiency config dict first).""",
        names={"DeepSpeedDataSampler": "ds_data:DataSampler"}),
    "runtime.data_pipeline.data_sampling.indexed_dataset": Module(
        """DeepSpeed's ``deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset``: ds-data's
`MMapIndexedDataset` and `MMapIndexedDatasetBuilder` (Megatron's ``.bin``/``.idx`` layout). The older
``IndexedDataset`` formats and the module's helpers are not built: importing them is an ImportError naming them.""",
        names=_of("ds_data", "MMapIndexedDataset MMapIndexedDatasetBuilder"),
        refused=("IndexedDataset IndexedCachedDataset IndexedDatasetBuilder make_builder make_dataset dataset_exists get_available_dataset_impl infer_dataset_impl read_longs write_longs dtypes valid_dtypes code index_file_path data_file_path create_doc_idx exscan_from_cumsum_ get_pointers_with_total", "the indexed dataset's older formats and helpers")),
    "runtime.data_pipeline.data_sampling.utils": Module(
        """DeepSpeed's ``deepspeed.runtime.data_pipeline.data_sampling.utils``: its helpers are not built (ds-data's
analyzer splits the work and writes its files itself); importing them is an ImportError naming them.""",
        refused=("find_fit_int_dtype split_index split_dataset create_mmap_dataset_builder close_mmap_dataset_builder", "the data analyzer's helpers")),
    "runtime.data_pipeline.data_sampling.variable_batch_size_and_lr": Module(
        """DeepSpeed's ``deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr``: batches packed by
token count and the learning rate scaled per batch, ds-data's (`ds_data.batch_by_seqlens` & co). As in DeepSpeed
the engine does not act on ``data_sampling.dynamic_batching``: the script builds its loader and scheduler with
`get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed`, which reads the section.""",
        names=_of("ds_data", "VariableBatchSizeLR batch_by_seqlens dataloader_for_variable_batch_size get_dataloader_and_lr_scheduler_for_variable_batch_size get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed lr_scheduler_for_variable_batch_size scale_lr")),
    "runtime.dataloader": Module(
        """DeepSpeed's ``deepspeed.runtime.dataloader``.""",
        names=_of("ds_all._data", "RepeatingLoader")),
    "runtime.engine": Module(
        """DeepSpeed's ``deepspeed.runtime.engine``.""",
        names=_of("ds_all._engine", "DeepSpeedEngine")),
    "runtime.fp16": Module(
        """DeepSpeed's ``deepspeed.runtime.fp16``: its ``loss_scaler`` module.""",
        submodules="loss_scaler"),
    "runtime.fp16.fused_optimizer": Module(
        """DeepSpeed's ``deepspeed.runtime.fp16.fused_optimizer``: ``FP16_Optimizer``, true of an engine's optimizer at
stage 0 in fp16 over a fused Adam (ds-zero's `ZeroOptimizer`; see ``ds_all._optimizer_kinds``).""",
        names=_of("ds_all._optimizer_kinds", "FP16_Optimizer")),
    "runtime.fp16.loss_scaler": Module(
        """DeepSpeed's ``deepspeed.runtime.fp16.loss_scaler`` is ds-zero's loss-scaler objects.""",
        names=_of("ds_zero", "CreateLossScaler DynamicLossScaler LossScaler LossScalerBase"),
        constants={'INITIAL_LOSS_SCALE': 'init_scale', 'SCALE_WINDOW': 'scale_window', 'DELAYED_SHIFT': 'delayed_shift', 'CONSECUTIVE_HYSTERESIS': 'consecutive_hysteresis', 'MIN_LOSS_SCALE': 'min_scale'}),
    "runtime.fp16.unfused_optimizer": Module(
        """DeepSpeed's ``deepspeed.runtime.fp16.unfused_optimizer``: ``FP16_UnfusedOptimizer``, true of an engine's
optimizer at stage 0 in fp16 over an optimizer other than a fused Adam (ds-zero's `ZeroOptimizer`; see
``ds_all._optimizer_kinds``).""",
        names=_of("ds_all._optimizer_kinds", "FP16_UnfusedOptimizer")),
    "runtime.lr_schedules": Module(
        """DeepSpeed's ``deepspeed.runtime.lr_schedules`` is ``ds_all.lr_schedules``.""",
        star="ds_all.lr_schedules"),
    "runtime.pipe": Module(
        """DeepSpeed's ``deepspeed.runtime.pipe``: ds-pipe's modules and ds-comm's topologies.""",
        names=_of("ds_comm", "ProcessTopology") | _of("ds_pipe", "LayerSpec PipelineModule TiedLayerSpec"),
        submodules="engine module schedule topology"),
    "runtime.pipe.engine": Module(
        """DeepSpeed's ``deepspeed.runtime.pipe.engine``.""",
        names=_of("ds_all._pipe_engine", "PipelineEngine")),
    "runtime.pipe.module": Module(
        """DeepSpeed's ``deepspeed.runtime.pipe.module``.""",
        names=_of("ds_pipe", "LayerSpec PipelineModule TiedLayerSpec")),
    "runtime.pipe.schedule": Module(
        """DeepSpeed's ``deepspeed.runtime.pipe.schedule``: the schedules and their instructions (ds-pipe).""",
        names=_of("ds_pipe", "BackwardPass DataParallelSchedule ForwardPass InferenceSchedule LoadMicroBatch OptimizerStep PipeInstruction RecvActivation RecvGrad ReduceGrads ReduceTiedGrads SendActivation SendGrad TrainSchedule") | _of("ds_pipe.schedule", "PipeSchedule")),
    "runtime.pipe.topology": Module(
        """DeepSpeed's ``deepspeed.runtime.pipe.topology``.""",
        names=_of("ds_comm", "PipeDataParallelTopology PipeModelDataParallelTopology ProcessTopology") | _of("ds_pipe", "PipelineParallelGrid")),
    "runtime.progressive_layer_drop": Module(
        """DeepSpeed's ``deepspeed.runtime.progressive_layer_drop`` (releases before 0.19) is ds-data's
`ProgressiveLayerDrop`.""",
        legacy="progressive layer dropping, removed in DeepSpeed 0.19",
        names=_of("ds_data", "ProgressiveLayerDrop")),
    "runtime.sequence_parallel": Module(
        """DeepSpeed's ``deepspeed.runtime.sequence_parallel``: ``parallel_state_sp``, the sequence-parallel mpu."""),
    "runtime.zero": Module(
        """DeepSpeed's ``deepspeed.runtime.zero`` is ds-zero.""",
        star="ds_zero",
        submodules="offload_config partition_parameters utils"),
    "runtime.zero.offload_config": Module(
        """DeepSpeed's ``deepspeed.runtime.zero.offload_config``.""",
        names=_of("ds_zero", "OffloadDeviceEnum OffloadOptimizerConfig OffloadParamConfig OffloadStateTypeEnum") | {"DeepSpeedZeroOffloadOptimizerConfig": "ds_zero:OffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig": "ds_zero:OffloadParamConfig"},
        extra="OffloadOptimizerConfig OffloadParamConfig"),
    "runtime.zero.stage3": Module(
        """DeepSpeed's ``deepspeed.runtime.zero.stage3``: ``DeepSpeedZeroOptimizer_Stage3``, true of an engine's
optimizer at ZeRO stage 3 (ds-zero's `ZeroOptimizer`; see ``ds_all._optimizer_kinds``).""",
        names=_of("ds_all._optimizer_kinds", "DeepSpeedZeroOptimizer_Stage3")),
    "runtime.zero.stage_1_and_2": Module(
        """DeepSpeed's ``deepspeed.runtime.zero.stage_1_and_2``: ``DeepSpeedZeroOptimizer``, true of an engine's
optimizer at ZeRO stage 1 or 2 (ds-zero's `ZeroOptimizer`; see ``ds_all._optimizer_kinds``).""",
        names=_of("ds_all._optimizer_kinds", "DeepSpeedZeroOptimizer")),
    "runtime.zero.utils": Module(
        """DeepSpeed's ``deepspeed.runtime.zero.utils``: its exception type.""",
        names=_of("ds_zero", "ZeRORuntimeException")),
    "sequence": Module(
        """DeepSpeed's ``deepspeed.sequence``: Ulysses sequence parallelism and its loss, ds-parallel's, under DeepSpeed's module
path (``from ds_all.sequence.layer import DistributedAttention``).""",
        submodules="cross_entropy layer"),
    "sequence.cross_entropy": Module(
        """DeepSpeed's ``deepspeed.sequence.cross_entropy``: ds-parallel's ``vocab_sequence_parallel_cross_entropy``
(the Ulysses loss Megatron-DeepSpeed imports from here), under DeepSpeed's module path
(``from ds_all.sequence.cross_entropy import vocab_sequence_parallel_cross_entropy``).""",
        names=_of("ds_parallel", "vocab_sequence_parallel_cross_entropy")),
    "sequence.layer": Module(
        """DeepSpeed's ``deepspeed.sequence.layer``: ds-parallel's Ulysses attention (``DistributedAttention``) and
its differentiable all-to-all (DeepSpeed's private ``_SeqAllToAll``, which Megatron-DeepSpeed calls).""",
        names=_of("ds_parallel", "DistributedAttention") | {"_SeqAllToAll": "ds_parallel:SeqAllToAll"}),
    "utils": Module(
        """DeepSpeed's ``deepspeed.utils``: ``logger``, ``log_dist``, ``RepeatingLoader``, ``set_random_seed``, the
``groups`` module (the process groups of each kind of parallelism), and the state-access functions of
``tensor_fragment`` (``safe_get_full_fp32_param``, ``safe_set_full_optimizer_state``, ...: ds-zero's).""",
        names=_of("ds_all._data", "RepeatingLoader") | _of("ds_all._utils", "log_dist logger set_random_seed") | _of("ds_zero", SAFE_FUNCTIONS) | _of("ds_all.utils.z3_leaf_module", "get_z3_leaf_modules set_z3_leaf_module set_z3_leaf_modules set_z3_leaf_modules_by_name set_z3_leaf_modules_by_suffix unset_z3_leaf_modules z3_leaf_module z3_leaf_parameter"),
        submodules="groups tensor_fragment",
        extra="set_random_seed"),
    "utils.tensor_fragment": Module(
        """DeepSpeed's ``deepspeed.utils.tensor_fragment``: the state-access functions (`ds_zero`'s), which read and
write a parameter's float32 master weights, gradient and optimizer states wherever ZeRO keeps them.""",
        names=_of("ds_zero", SAFE_FUNCTIONS)),
    "utils.z3_leaf_module": Module(
        """DeepSpeed's ``deepspeed.utils.z3_leaf_module``: ZeRO-3 leaf modules (one fetch unit with everything
below them; a Mixture-of-Experts block), ds-zero's.""",
        names=_of("ds_zero", "apply_zero_leaf_module_config get_z3_leaf_modules set_z3_leaf_module set_z3_leaf_modules set_z3_leaf_modules_by_name set_z3_leaf_modules_by_suffix unset_z3_leaf_modules z3_leaf_module z3_leaf_parameter")),
    "utils.zero_to_fp32": Module(
        """DeepSpeed's ``deepspeed.utils.zero_to_fp32``: the float32 weights of a ZeRO checkpoint (ds-zero's export,
any stage and world size), as a state dict or loaded into a model. The command line is ``ds-zero-to-fp32``.""",
        names=_of("ds_zero", "convert_zero_checkpoint_to_fp32_state_dict convert_zero_checkpoint_to_state_dict get_fp32_state_dict_from_zero_checkpoint load_state_dict_from_zero_checkpoint")),
    "zero": Module(
        """DeepSpeed's ``deepspeed.zero`` is ds-zero: ``ds_all.zero.Init``, ``GatheredParameters``, ...""",
        star="ds_zero"),
    # ---- hand-written modules at DeepSpeed's paths (code of their own)
    "checkpoint.utils": Module(None, hand=True, provides="clone_tensors_for_torch_save"),
    "checkpointing": Module(None, hand=True, names=_of("ds_parallel", "get_cuda_rng_tracker CudaRNGStatesTracker"),
                            provides="checkpoint configure is_configured model_parallel_cuda_manual_seed reset"),
    "comm": Module(None, hand=True, star="ds_comm", provides="get_world_group initialize_mesh_device"),
    "autotuning.autotuner": Module(None, hand=True, provides="Autotuner"),
    "git_version_info": Module(None, hand=True, provides="version git_hash git_branch torch_info installed_ops "
                                                          "accelerator_name ds_version",
        extra="ds_version"),
    "launcher.runner": Module(None, hand=True, names={"parse_args": "ds_launch:parse_deepspeed_args"},
                              provides="main"),
    "module_inject.layers": Module(None, hand=True, provides="AUTOTP_MODE LinearAllreduce LinearLayer "
                                                             "get_auto_tp_mode is_autotp_training_mode set_autotp_mode"),
    "module_inject.tp_shard": Module(None, hand=True, provides="AutoTPMeta get_shard_size get_shard_size_list"),
    "monitor": Module(None, hand=True),
    "ops": Module(None, hand=True, star="ds_ops", submodules="adagrad adam lamb lion op_builder sparse_attention",
        extra="sparse_attention"),
    "runtime.data_pipeline": Module(None, hand=True),
    "runtime.sequence_parallel.parallel_state_sp": Module(None, hand=True, provides=(
        "get_model_parallel_group get_model_parallel_rank get_model_parallel_world_size "
        "get_sequence_data_parallel_group get_sequence_data_parallel_rank get_sequence_data_parallel_world_size "
        "get_sequence_parallel_group get_sequence_parallel_rank get_sequence_parallel_world_size "
        "initialize_sequence_parallel")),
    "runtime.utils": Module(None, hand=True, names=_of("ds_all._utils", "set_random_seed"),
                            provides="is_model_parallel_parameter"),
    "runtime.zero.partition_parameters": Module(
        None, hand=True,
        names=_of("ds_zero", "GatheredParameters Init ZeroParamStatus register_external_parameter "
                             "unregister_external_parameter") | _of("ds_ops", "get_accelerator"),
        provides="zero_wrapper_for_fp_tensor_constructor _orig_torch_arange"),
    "sequence.fpdt_layer": Module(None, hand=True, provides="FPDT_InputConstruct _FPDTGPUOffloadingAttentionImpl_"),
    "utils.groups": Module(None, hand=True, provides=(
        "mpu get_data_parallel_group get_data_parallel_rank get_data_parallel_world_size get_model_parallel_group "
        "get_model_parallel_rank get_model_parallel_world_size get_sequence_data_parallel_group "
        "get_sequence_data_parallel_rank get_sequence_data_parallel_world_size get_sequence_parallel_group "
        "get_sequence_parallel_rank get_sequence_parallel_world_size get_tensor_model_parallel_group "
        "get_tensor_model_parallel_rank get_tensor_model_parallel_src_rank get_tensor_model_parallel_world_size "
        "set_tensor_model_parallel_rank set_tensor_model_parallel_world_size"),
        extra=(
        "get_sequence_data_parallel_group get_sequence_data_parallel_rank get_sequence_data_parallel_world_size "
        "get_sequence_parallel_group get_sequence_parallel_rank get_sequence_parallel_world_size")),
    "utils.torch": Module(None, hand=True, provides="register_grad_hook required_torch_version"),
}
