"""The op table and the bus-bandwidth factors: a leaf module (it imports nothing of ds_comm), so
that the config, the logger and the collectives can all read it without an import cycle."""

from __future__ import annotations

OPS = frozenset({
    "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
    "reduce_scatter_tensor", "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "barrier", "monitored_barrier", "reduce_scatter_bucket", "all_gather_bucket",
    "quantized_all_gather", "quantized_reduce_scatter",
})
# Point-to-point ops: their bytes go to one peer, not spread over the group (no node-boundary share).
P2P = frozenset({"send", "recv", "isend", "irecv", "batch_isend_irecv"})

# Bus-bandwidth factors (as nccl-tests defines them): the share of the message each rank sends.
_RING_ALL_REDUCE = frozenset({"all_reduce", "all_reduce_coalesced"})
_ONE_OF_N = frozenset({"all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
                       "reduce_scatter_bucket", "all_gather_bucket",
                       "quantized_all_gather", "quantized_reduce_scatter"})
_NO_DATA = frozenset({"barrier", "monitored_barrier"})


def bus_factor(op: str, world_size: int) -> float:
    n = max(world_size, 1)
    if op in _RING_ALL_REDUCE:
        return 2.0 * (n - 1) / n
    if op in _ONE_OF_N:
        return (n - 1) / n
    if op in _NO_DATA:
        return 0.0
    return 1.0
