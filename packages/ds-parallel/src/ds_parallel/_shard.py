"""How AutoTP splits one dimension over a tensor-parallel group when the group size does not divide it
(DeepSpeed's ``module_inject.tp_shard`` rules), so that a layer built here holds the same shard as DeepSpeed's.

* With a known key/value head count that divides the dimension (attention projections), the split is by whole
  heads: rank ``r`` gets ``kv // tp`` heads, one more while ``r < kv % tp``. Layers whose name says MLP
  (``mlp``, ``gate_proj``, ``up_proj``, ``down_proj``, ``w1``-``w3``) and output heads (``lm_head``,
  ``embed_out``) are never split by heads.
* Otherwise the dimension is cut in grains of ``grain_size`` elements: rank ``r`` gets ``grains // tp`` grains,
  one more while ``r < grains % tp``, and the last rank also the ``size % grain_size`` elements left over. A
  dimension smaller than one grain is split element by element the same way.

The shards are in rank order and tile the dimension exactly.
"""

from __future__ import annotations

_OUTPUT_HEADS = ("lm_head", "embed_out")
_MLP_NAMES = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def _positive_int(value: object, what: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


def get_shard_size(total_size: int, mp_size: int, rank: int, name: str | None = None, *,
                   num_kv_heads: int | None = None, grain_size: int = 1) -> int:
    """The size of tensor-parallel rank ``rank``'s shard (``0 <= rank < mp_size``) of a dimension of
    ``total_size`` elements in the layer called ``name`` (module docstring for the rules)."""
    _positive_int(total_size, "get_shard_size: total_size", 0)
    _positive_int(mp_size, "get_shard_size: mp_size")
    _positive_int(grain_size, "get_shard_size: grain_size")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < mp_size:
        raise ValueError(f"get_shard_size: rank must be an integer in [0, {mp_size}), got {rank!r}")
    if num_kv_heads is not None:
        _positive_int(num_kv_heads, "get_shard_size: num_kv_heads")
    label = str(name)
    by_heads = (num_kv_heads is not None and total_size % num_kv_heads == 0 and "mlp" not in label
                and label not in _OUTPUT_HEADS and not (name is not None and any(s in label for s in _MLP_NAMES)))
    if by_heads:
        heads = num_kv_heads // mp_size + (1 if rank < num_kv_heads % mp_size else 0)
        return total_size * heads // num_kv_heads
    if total_size < grain_size:
        return total_size // mp_size + (1 if rank < total_size % mp_size else 0)
    grains, remainder = divmod(total_size, grain_size)
    size = (grains // mp_size + (1 if rank < grains % mp_size else 0)) * grain_size
    return size + remainder if rank == mp_size - 1 else size


def get_shard_size_list(total_size: int, mp_size: int, name: str | None = None, *, num_kv_heads: int | None = None,
                        grain_size: int = 1) -> list[int]:
    """Every rank's shard size of a dimension of ``total_size`` split over ``mp_size`` ranks, in rank order
    (DeepSpeed's ``get_shard_size_list``; module docstring for the rules). They add up to ``total_size``."""
    _positive_int(mp_size, "get_shard_size_list: mp_size")
    sizes = [get_shard_size(total_size, mp_size, r, name, num_kv_heads=num_kv_heads, grain_size=grain_size)
             for r in range(mp_size)]
    if sum(sizes) != total_size:  # the rules above tile exactly; this guards a future rule
        raise RuntimeError(f"get_shard_size_list: shards {sizes} of layer {name!r} do not add up to {total_size}")
    return sizes
