"""The public API of ds-moe is small and pinned."""

import ds_moe
from ds_moe import groups


def test_public_api_is_pinned():
    assert sorted(ds_moe.__all__) == [
        "AllToAll", "Experts", "MOELayer", "MoE", "Routing", "TopKGate", "__version__", "configure_moe_param_groups",
        "expert_checkpoint_names", "groups", "gumbel_rsample", "has_moe_layers", "is_moe_param", "is_moe_param_group",
        "multiplicative_jitter", "route_slots", "sparse_decode", "sparse_encode",
        "split_params_grads_into_shared_and_expert_params", "split_params_into_different_moe_groups_for_optimizer",
        "split_params_into_shared_and_expert_params", "top1gating", "top2gating", "topkgating"]
    assert all(hasattr(ds_moe, name) for name in ds_moe.__all__)
    assert ds_moe.__version__ == "0.1.0"


def test_groups_module_holds_deepspeeds_expert_group_functions():
    assert sorted(groups.__all__) == [
        "_create_expert_and_data_parallel", "_get_expert_broadcast_src_rank", "_get_expert_data_parallel_group",
        "_get_expert_data_parallel_group_dict", "_get_expert_data_parallel_group_ranks",
        "_get_expert_data_parallel_rank", "_get_expert_data_parallel_world_size", "_get_expert_parallel_group",
        "_get_expert_parallel_group_dict", "_get_expert_parallel_group_ranks", "_get_expert_parallel_rank",
        "_get_expert_parallel_src_rank", "_get_expert_parallel_world_size", "_get_max_expert_parallel_group",
        "_get_max_expert_size", "_get_max_expert_size_name", "_reset_expert_groups"]
    assert all(callable(getattr(groups, name)) for name in groups.__all__)


def test_the_readme_example_runs():
    import pathlib
    import re

    readme = pathlib.Path(__file__).resolve().parents[1] / "README.md"
    (code,) = re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)
    scope = {}
    exec(compile(code, str(readme), "exec"), scope)
    assert [g["name"] for g in scope["groups"]] == ["p", "ep_size_1"]
    assert scope["l_aux"].dim() == 0 and all(p.grad is not None for p in scope["net"].parameters())
