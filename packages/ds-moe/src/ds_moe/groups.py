"""DeepSpeed's ``deepspeed.utils.groups`` expert functions (``ep_size_<N>`` named groups), see `_groups`."""

from ._groups import (
    _create_expert_and_data_parallel,
    _get_expert_broadcast_src_rank,
    _get_expert_data_parallel_group,
    _get_expert_data_parallel_group_dict,
    _get_expert_data_parallel_group_ranks,
    _get_expert_data_parallel_rank,
    _get_expert_data_parallel_world_size,
    _get_expert_parallel_group,
    _get_expert_parallel_group_dict,
    _get_expert_parallel_group_ranks,
    _get_expert_parallel_rank,
    _get_expert_parallel_src_rank,
    _get_expert_parallel_world_size,
    _get_max_expert_parallel_group,
    _get_max_expert_size,
    _get_max_expert_size_name,
    _reset_expert_groups,
)

__all__ = [
    "_create_expert_and_data_parallel", "_get_expert_broadcast_src_rank", "_get_expert_data_parallel_group",
    "_get_expert_data_parallel_group_dict", "_get_expert_data_parallel_group_ranks", "_get_expert_data_parallel_rank",
    "_get_expert_data_parallel_world_size", "_get_expert_parallel_group", "_get_expert_parallel_group_dict",
    "_get_expert_parallel_group_ranks", "_get_expert_parallel_rank", "_get_expert_parallel_src_rank",
    "_get_expert_parallel_world_size", "_get_max_expert_parallel_group", "_get_max_expert_size",
    "_get_max_expert_size_name", "_reset_expert_groups",
]
