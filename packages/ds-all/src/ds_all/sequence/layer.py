# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.sequence.layer``: ds-parallel's Ulysses attention (``DistributedAttention``) and
its differentiable all-to-all (DeepSpeed's private ``_SeqAllToAll``, which Megatron-DeepSpeed calls)."""

from ds_parallel import DistributedAttention
from ds_parallel import SeqAllToAll as _SeqAllToAll

__all__ = ["DistributedAttention", "_SeqAllToAll"]
