"""The public API of ds-parallel is pinned, and the README's example runs (2 ranks)."""

import pathlib
import re

import torch

import ds_parallel
from ds_comm.testing import spawn


def test_public_api_is_pinned():
    assert sorted(ds_parallel.__all__) == sorted([
        "__version__",
        # Megatron's tensor parallelism (mappings, layers, cross entropy, RNG) and the mpu
        "ColumnParallelLinear", "CudaRNGStatesTracker", "ModelParallelUnit", "RowParallelLinear",
        "VocabParallelEmbedding", "copy_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
        "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed", "param_is_not_tensor_parallel_duplicate",
        "reduce_from_tensor_model_parallel_region", "scatter_to_tensor_model_parallel_region",
        "set_tensor_model_parallel_attributes", "vocab_parallel_cross_entropy", "vocab_range_from_global_vocab_size",
        # Ulysses sequence parallelism
        "DistributedAttention", "SeqAllToAll", "seq_all_to_all", "vocab_sequence_parallel_cross_entropy",
        # AutoTP
        "LinearAllreduce", "LinearLayer", "replace_module_consolidated_state_dict", "tp_model_init",
        "AutoTPConfig", "TPLayerSpec", "apply_partition_config", "get_shard_size", "get_shard_size_list",
        "fpdt_token_order",
    ])
    assert len(set(ds_parallel.__all__)) == len(ds_parallel.__all__)
    assert all(hasattr(ds_parallel, name) for name in ds_parallel.__all__)
    assert ds_parallel.__version__ == "0.1.0"


def run_readme_example(rank, world_size):
    readme = pathlib.Path(__file__).resolve().parents[1] / "README.md"
    code = re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)[0]
    scope = {}
    exec(compile(code, str(readme), "exec"), scope)  # init_distributed returns at once: spawn made the group
    scope["loss"].backward()
    assert scope["logits"].shape == (8, 32, 1024 // world_size)
    assert all(p.grad is not None for m in ("emb", "fc1", "fc2") for p in scope[m].parameters())
    return round(scope["loss"].item(), 5)


def test_readme_example_runs():
    losses = spawn(run_readme_example, world_size=2)
    assert losses[0] == losses[1]  # the loss is replicated across tensor-parallel ranks
    assert abs(losses[0] - torch.log(torch.tensor(1024.0)).item()) < 0.5  # ~ uniform over the vocabulary at init
