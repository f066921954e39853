"""DeepSpeed's ``deepspeed.module_inject.tp_shard``: how AutoTP splits a dimension that the tensor-parallel
size does not divide (ds-parallel's `get_shard_size_list` rules), with the model metadata DeepSpeed 0.19.8
passes (`AutoTPMeta`: the key/value head count, which lets attention projections split by whole heads, and
the split grain).

Both DeepSpeed signatures are taken: 0.19.8's ``get_shard_size_list(total_size, mp_size, meta, name=None)``
and 0.19.6's ``get_shard_size_list(total_size, mp_size, name=None)`` (a third argument that is a layer name or
None, as DeepSpeed's own tests of that version pass it, means no metadata)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ds_parallel

from .. import comm as dist

__all__ = ["AutoTPMeta", "get_shard_size", "get_shard_size_list"]

# where a model config keeps its key/value head count, then its query head count (kv == q heads), in order
_KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv", "kv_n_heads",
                  "num_attention_heads", "n_heads", "attention_heads")
_ATTN_HEAD_ATTRS = ("num_attention_heads", "num_heads", "n_heads", "n_head", "attention_heads")


def _first(config: Any, names: tuple[str, ...]) -> Any:
    return next((getattr(config, n) for n in names if getattr(config, n, None) is not None), None)


@dataclass(frozen=True)
class AutoTPMeta:
    """A model's tensor-parallel metadata (DeepSpeed 0.19.8's): ``num_kv_heads``, ``num_attention_heads``,
    ``n_embd`` and ``tp_grain_size``. `from_model_config` reads a Hugging Face config (its ``text_config``
    when it has one)."""

    num_kv_heads: int | None = None
    num_attention_heads: int | None = None
    n_embd: int | None = None
    tp_grain_size: int = 1

    @classmethod
    def from_model_config(cls, model_config: Any, tp_grain_size: int = 1) -> AutoTPMeta:
        if model_config is None:
            return cls(tp_grain_size=tp_grain_size)
        model_config = getattr(model_config, "text_config", None) or model_config
        return cls(num_kv_heads=_first(model_config, _KV_HEAD_ATTRS),
                   num_attention_heads=_first(model_config, _ATTN_HEAD_ATTRS),
                   n_embd=_first(model_config, ("n_embd", "hidden_size")), tp_grain_size=tp_grain_size)


def _meta_and_name(meta: Any, name: Any, where: str) -> tuple[AutoTPMeta, Any]:
    if isinstance(meta, AutoTPMeta):
        return meta, name
    if name is None and (meta is None or isinstance(meta, str)):  # DeepSpeed 0.19.6: (total, mp_size, name)
        return AutoTPMeta(), meta
    raise ValueError(f"{where}: the third argument must be an AutoTPMeta (DeepSpeed 0.19.8) or a layer name "
                     f"(0.19.6), got {type(meta).__name__}")


def get_shard_size(total_size: int, mp_size: int, meta: Any = None, name: Any = None, rank: int | None = None,
                   mp_group: Any = None) -> int:
    """The shard size of tensor-parallel rank ``rank`` (default: this rank in ``mp_group``, or in the whole
    world when ``mp_size`` is its size)."""
    meta, name = _meta_and_name(meta, name, "get_shard_size")
    if rank is None:
        if mp_group is not None:
            rank = dist.get_rank(group=mp_group)
        elif dist.get_world_size() == mp_size:
            rank = dist.get_rank()
        else:
            raise ValueError(f"get_shard_size: give rank or mp_group when mp_size ({mp_size}) is not the world "
                             f"size ({dist.get_world_size()})")
    return ds_parallel.get_shard_size(total_size, mp_size, rank, name, num_kv_heads=meta.num_kv_heads,
                                      grain_size=meta.tp_grain_size)


def get_shard_size_list(total_size: int, mp_size: int, meta: Any = None, name: Any = None) -> list[int]:
    """Every tensor-parallel rank's shard size, in rank order; they add up to ``total_size``."""
    meta, name = _meta_and_name(meta, name, "get_shard_size_list")
    return ds_parallel.get_shard_size_list(total_size, mp_size, name, num_kv_heads=meta.num_kv_heads,
                                           grain_size=meta.tp_grain_size)
