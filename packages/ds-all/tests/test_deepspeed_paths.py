"""DeepSpeed's module tree under ``ds_all``: every import path a DeepSpeed script uses is a real module whose
names are the owning part's objects, the small helpers scripts import from it behave as DeepSpeed's, and
DeepSpeedExamples' CIFAR-10 script runs with only its import changed, with DeepSpeed 0.19.8's losses."""

from __future__ import annotations

import importlib
import importlib.metadata
import io
import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ds_all
import ds_comm
import ds_launch
import ds_ops
import ds_parallel
import ds_pipe
import ds_zero
from ds_comm.testing import free_port, spawn

EXAMPLES = Path(__file__).parent / "deepspeed_examples"

# (module path as a DeepSpeed script imports it with "deepspeed" -> "ds_all", name, the owner's object)
PATHS = [
    ("ds_all.accelerator", "get_accelerator", ds_ops.get_accelerator),
    ("ds_all.sequence.layer", "DistributedAttention", ds_parallel.DistributedAttention),
    ("ds_all.sequence.cross_entropy", "vocab_sequence_parallel_cross_entropy",
     ds_parallel.vocab_sequence_parallel_cross_entropy),
    ("ds_all.runtime.activation_checkpointing.checkpointing", "get_cuda_rng_tracker", ds_parallel.get_cuda_rng_tracker),
    ("ds_all.comm", "all_reduce", ds_comm.all_reduce),
    ("ds_all.comm", "init_distributed", ds_comm.init_distributed),
    ("ds_all.comm", "inference_all_reduce", ds_comm.inference_all_reduce),
    ("ds_all.zero", "Init", ds_zero.Init),
    ("ds_all.zero", "GatheredParameters", ds_zero.GatheredParameters),
    ("ds_all.runtime.zero", "Init", ds_zero.Init),
    ("ds_all.zero", "ZeroParamStatus", ds_zero.ZeroParamStatus),
    ("ds_all.runtime.zero.partition_parameters", "ZeroParamStatus", ds_zero.ZeroParamStatus),
    ("ds_all.runtime.zero.partition_parameters", "GatheredParameters", ds_zero.GatheredParameters),
    ("ds_all.runtime.zero.partition_parameters", "Init", ds_zero.Init),
    ("ds_all.runtime.zero.partition_parameters", "register_external_parameter",
     ds_zero.register_external_parameter),
    ("ds_all.runtime.zero.offload_config", "OffloadDeviceEnum", ds_zero.OffloadDeviceEnum),
    ("ds_all.runtime.zero.offload_config", "OffloadStateTypeEnum", ds_zero.OffloadStateTypeEnum),
    ("ds_all.runtime.zero.utils", "ZeRORuntimeException", ds_zero.ZeRORuntimeException),
    ("ds_all.runtime.bf16_optimizer", "BF16_Optimizer", ds_zero.ZeroOptimizer),
    ("ds_all.ops.adam", "DeepSpeedCPUAdam", ds_ops.CPUAdam),
    ("ds_all.ops.adam", "FusedAdam", ds_ops.FusedAdam),
    ("ds_all.ops.adagrad", "DeepSpeedCPUAdagrad", ds_ops.CPUAdagrad),
    ("ds_all.ops.lion", "DeepSpeedCPULion", ds_ops.CPULion),
    ("ds_all.ops.lamb", "FusedLamb", ds_ops.FusedLamb),
    ("ds_all.ops.op_builder", "CPUAdamBuilder", ds_ops.op_builder.CPUAdamBuilder),
    ("ds_all.ops.sparse_attention", "SparseSelfAttention", ds_ops.sparse_attention.SparseSelfAttention),
    ("ds_all.pipe", "PipelineModule", ds_pipe.PipelineModule),
    ("ds_all.runtime.pipe", "PipelineModule", ds_pipe.PipelineModule),
    ("ds_all.runtime.pipe.module", "LayerSpec", ds_pipe.LayerSpec),
    ("ds_all.runtime.pipe.module", "TiedLayerSpec", ds_pipe.TiedLayerSpec),
    ("ds_all.runtime.pipe.topology", "PipeDataParallelTopology", ds_comm.PipeDataParallelTopology),
    ("ds_all.runtime.pipe.topology", "ProcessTopology", ds_comm.ProcessTopology),
    ("ds_all.runtime.pipe.schedule", "TrainSchedule", ds_pipe.TrainSchedule),
    ("ds_all.runtime.pipe.engine", "PipelineEngine", ds_all.PipelineEngine),
    ("ds_all.runtime.engine", "DeepSpeedEngine", ds_all.DeepSpeedEngine),
    ("ds_all.runtime.dataloader", "RepeatingLoader", ds_all.utils.RepeatingLoader),
    ("ds_all.runtime.utils", "set_random_seed", ds_all.utils.set_random_seed),
    ("ds_all.utils", "safe_get_full_fp32_param", ds_zero.safe_get_full_fp32_param),
    ("ds_all.utils", "safe_get_full_grad", ds_zero.safe_get_full_grad),
    ("ds_all.utils", "safe_get_full_optimizer_state", ds_zero.safe_get_full_optimizer_state),
    ("ds_all.utils", "safe_get_local_fp32_param", ds_zero.safe_get_local_fp32_param),
    ("ds_all.utils", "safe_get_local_grad", ds_zero.safe_get_local_grad),
    ("ds_all.utils", "safe_get_local_optimizer_state", ds_zero.safe_get_local_optimizer_state),
    ("ds_all.utils", "safe_set_full_fp32_param", ds_zero.safe_set_full_fp32_param),
    ("ds_all.utils", "safe_set_full_grad", ds_zero.safe_set_full_grad),
    ("ds_all.utils", "safe_set_full_optimizer_state", ds_zero.safe_set_full_optimizer_state),
    ("ds_all.utils", "safe_set_local_fp32_param", ds_zero.safe_set_local_fp32_param),
    ("ds_all.utils", "safe_set_local_grad", ds_zero.safe_set_local_grad),
    ("ds_all.utils", "safe_set_local_optimizer_state", ds_zero.safe_set_local_optimizer_state),
    ("ds_all.utils", "safe_update_full_grad_vectorized", ds_zero.safe_update_full_grad_vectorized),
    ("ds_all.utils.zero_to_fp32", "convert_zero_checkpoint_to_fp32_state_dict",
     ds_zero.convert_zero_checkpoint_to_fp32_state_dict),
    ("ds_all.utils.zero_to_fp32", "get_fp32_state_dict_from_zero_checkpoint",
     ds_zero.get_fp32_state_dict_from_zero_checkpoint),
    ("ds_all.utils", "set_z3_leaf_modules", ds_zero.set_z3_leaf_modules),
    ("ds_all.utils", "z3_leaf_module", ds_zero.z3_leaf_module),
    ("ds_all.utils.tensor_fragment", "safe_get_full_fp32_param", ds_zero.safe_get_full_fp32_param),
    ("ds_all.utils.tensor_fragment", "safe_get_full_grad", ds_zero.safe_get_full_grad),
    ("ds_all.utils.tensor_fragment", "safe_get_full_optimizer_state", ds_zero.safe_get_full_optimizer_state),
    ("ds_all.utils.tensor_fragment", "safe_set_full_fp32_param", ds_zero.safe_set_full_fp32_param),
    ("ds_all.runtime.lr_schedules", "WarmupLR", ds_all.WarmupLR),
    ("ds_all.runtime.activation_checkpointing.checkpointing", "checkpoint", ds_all.checkpointing.checkpoint),
    ("ds_all.checkpointing", "configure", ds_all.checkpointing.configure),
    ("ds_all.elasticity", "compute_elastic_config", ds_launch.compute_elastic_config),
    ("ds_all.elasticity", "ElasticityConfigError", ds_launch.ElasticityConfigError),
    ("ds_all.elasticity", "ElasticityIncompatibleWorldSize", ds_launch.ElasticityIncompatibleWorldSize),
]


@pytest.mark.parametrize("path, name, owner", PATHS, ids=[f"{p}.{n}" for p, n, _ in PATHS])
def test_each_deepspeed_import_path_is_a_module_holding_the_owners_object(path, name, owner):
    module = importlib.import_module(path)  # `import deepspeed.x.y` works, not only attribute access
    assert type(module).__name__ == "module" and sys.modules[path] is module
    assert getattr(module, name) is owner
    # and `from deepspeed.x import y` / attribute access from the top, as scripts write it
    parent, _, leaf = path.rpartition(".")
    assert getattr(importlib.import_module(parent), leaf) is module


def test_utils_z3_leaf_module_is_the_function_and_its_module_imports_by_path():
    # as in DeepSpeed, whose deepspeed/utils/__init__.py imports the function over its own submodule's name
    import ds_all.utils
    from ds_all.utils.z3_leaf_module import set_z3_leaf_modules
    assert set_z3_leaf_modules is ds_zero.set_z3_leaf_modules
    assert ds_all.utils.z3_leaf_module is ds_zero.z3_leaf_module
    assert type(sys.modules["ds_all.utils.z3_leaf_module"]).__name__ == "module"


def test_import_ds_all_comm_as_dist_is_ds_comm():
    import ds_all.comm as dist

    assert set(ds_comm.__all__) <= set(dir(dist)) and dist.get_rank is ds_comm.get_rank


def test_lr_schedules_module_constants_are_deepspeeds():
    from ds_all.runtime import lr_schedules

    assert lr_schedules.VALID_LR_SCHEDULES == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    assert (lr_schedules.WARMUP_LOG_RATE, lr_schedules.WARMUP_LINEAR_RATE) == ("log", "linear")
    assert lr_schedules.TOTAL_NUM_STEPS == "total_num_steps" and lr_schedules.LR_RANGE_TEST == "LRRangeTest"
    assert all(getattr(ds_all.lr_schedules, name) is not None for name in ds_all.lr_schedules.__all__)


def test_version_attributes():
    major, minor, patch = (int(p) for p in ds_all.__version__.split("."))
    assert (ds_all.__version_major__, ds_all.__version_minor__, ds_all.__version_patch__) == (major, minor, patch)
    assert isinstance(ds_all.__git_hash__, str) and isinstance(ds_all.__git_branch__, str)


def test_repeating_loader_starts_the_loader_again_and_stops_on_an_empty_one():
    from ds_all.utils import RepeatingLoader

    loader = torch.utils.data.DataLoader(torch.arange(5), batch_size=2)
    repeating = RepeatingLoader(loader)
    assert iter(repeating) is repeating
    got = [next(repeating).tolist() for _ in range(5)]
    assert got == [[0, 1], [2, 3], [4], [0, 1], [2, 3]]
    with pytest.raises(StopIteration):
        next(RepeatingLoader([]))


def test_set_random_seed_seeds_python_numpy_and_torch():
    import numpy

    from ds_all.runtime.utils import set_random_seed

    draws = []
    for _ in range(2):
        set_random_seed(1234)
        draws.append((random.random(), float(numpy.random.rand()), torch.rand(3).tolist()))
    assert draws[0] == draws[1]
    set_random_seed(1235)
    assert (random.random(), float(numpy.random.rand()), torch.rand(3).tolist()) != draws[0]


def _log_dist_lines(rank, world_size):
    from ds_all.utils import log_dist, logger

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    try:
        log_dist("to one", ranks=[1])
        log_dist("to all", ranks=[-1])
        log_dist("to none")  # no ranks: nowhere once the group exists (DeepSpeed's rule)
        log_dist("a warning", ranks=[0], level=logging.WARNING)
    finally:
        logger.removeHandler(handler)
    return stream.getvalue().splitlines()


def test_log_dist_logs_on_the_ranks_named():
    rank0, rank1 = spawn(_log_dist_lines, world_size=2)
    assert rank0 == ["[Rank 0] to all", "[Rank 0] a warning"]
    assert rank1 == ["[Rank 1] to one", "[Rank 1] to all"]


def test_the_deepspeed_logger_is_deepspeeds():
    from ds_all.utils import logger

    assert logger is logging.getLogger("DeepSpeed") and logger.level == logging.INFO and not logger.propagate


def _run_example(tmp_path: Path, script: str, *args: str) -> dict:
    out = tmp_path / "losses.json"
    env = {**{k: v for k, v in os.environ.items() if k != "DS_EXAMPLE_BACKEND"}, "DS_EXAMPLE_LOSSES": str(out)}
    # a port of its own: the default 29500 is taken by whichever example another pytest worker runs
    result = subprocess.run([sys.executable, "-m", "ds_launch", "--num_procs", "2", "--master_port", str(free_port()),
                             str(EXAMPLES / script), *args],
                            capture_output=True, text=True, timeout=300, env=env, cwd=EXAMPLES)
    assert result.returncode == 0 and out.exists(), result.stdout[-4000:] + result.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("stage, dtype", [(2, "fp32"), (3, "bf16")])
def test_deepspeed_cifar10_example_runs_with_deepspeeds_losses(tmp_path, stage, dtype):
    """DeepSpeedExamples' CIFAR-10 script (DeepSpeed's config with its deprecated ``cpu_offload``, Adam +
    WarmupLR, ``get_accelerator().device_name(engine.local_rank)``, ``bfloat16_enabled()``) gives the losses
    DeepSpeed 0.19.8 gave on the same data (fixtures made with DS_EXAMPLE_BACKEND=deepspeed: equal to the
    last bit on the CPU they came from; tolerance for other CPUs' kernels)."""
    expected = json.loads((EXAMPLES / "cifar10_losses.json").read_text())["runs"][f"stage {stage} {dtype}"]
    got = _run_example(tmp_path, "cifar10_deepspeed.py", "--stage", str(stage), "--dtype", dtype)
    tolerance = {"fp32": 1e-5, "bf16": 2e-2}[dtype]  # bf16: a loss may round one bf16 step the other way
    torch.testing.assert_close(torch.tensor(got["rank0"]), torch.tensor(expected["rank0"]), rtol=0, atol=tolerance)
    assert got["lr"] == pytest.approx(expected["lr"], rel=1e-12)


def test_the_names_deepspeeds_own_test_harness_imports():
    """DeepSpeed's tests/unit/util.py and common.py stop at their first import without these."""
    import torch

    import ds_all.git_version_info as info
    from ds_all.accelerator import SUPPORTED_ACCELERATOR_LIST, is_current_accelerator_supported
    from ds_all.utils.torch import required_torch_version

    assert is_current_accelerator_supported() and ds_all.get_accelerator().device_name() in SUPPORTED_ACCELERATOR_LIST
    assert info.version == ds_all.__version__ == "0.19.8" and info.ds_version == ds_all.__ds_version__
    assert info.torch_info["version"] == ".".join(torch.__version__.split(".")[:2])
    assert set(info.torch_info) >= {"version", "cuda_version", "nccl_version", "hip_version"}
    assert required_torch_version(min_version=1.8) and not required_torch_version(max_version="1.8")
    assert not required_torch_version(min_version="99.0")
    with pytest.raises(ValueError, match="min_version or max_version"):
        required_torch_version()


def test_compatible_ops_has_deepspeeds_names_for_the_fused_kernels():
    from ds_all.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder, FusedLambBuilder

    ops = ds_all.ops.__compatible_ops__
    assert ops is ds_all.ops.__compatible_ops__  # probed once, then the same dict (DeepSpeed's behaviour)
    assert {FusedAdamBuilder.NAME, FusedLambBuilder.NAME, CPUAdamBuilder.NAME} <= set(ops)
    assert ops[FusedAdamBuilder.NAME] == CPUAdamBuilder().compatibility()[0]
    if ops[FusedAdamBuilder.NAME]:
        assert FusedAdamBuilder().load() is CPUAdamBuilder().load()  # the kernel FusedAdam runs on CPU tensors
    with pytest.raises(AttributeError, match="no attribute '__compatible_opz__'"):
        ds_all.ops.__compatible_opz__  # noqa: B018


_VERSIONS = """
import importlib.metadata, sys
{setup}
import deepspeed
from deepspeed.git_version_info import version
from packaging import version as pv
meta = {meta}
print(deepspeed.__version__, version, meta, deepspeed.__ds_version__, pv.parse(deepspeed.__version__) >= pv.parse("0.14"))
"""


@pytest.mark.parametrize("how", ["ds-launch alias", "hf trainer"])
def test_deepspeed_version_is_one_answer_everywhere(how):
    """Scripts compare ``version.parse(deepspeed.__version__)`` with the DeepSpeed they need: under both aliases it is
    the DeepSpeed API version ds follows, equal to git_version_info.version and (Trainer alias) the metadata."""
    alias = Path(__file__).parents[2] / "ds-launch" / "src" / "ds_launch" / "_deepspeed_alias"
    setup, meta = ("", "None") if how == "ds-launch alias" else (
        "import ds_all.hf.trainer", "importlib.metadata.version('deepspeed')")
    env = {**os.environ, "PYTHONPATH": str(alias) if how == "ds-launch alias" else ""}
    done = subprocess.run([sys.executable, "-c", _VERSIONS.format(setup=setup, meta=meta)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    api, info, metadata, own, new_enough = done.stdout.split()
    assert api == info == "0.19.8" and metadata in ("None", api) and new_enough == "True"
    assert own == ds_all.__ds_version__ == importlib.metadata.version("ds-all")
