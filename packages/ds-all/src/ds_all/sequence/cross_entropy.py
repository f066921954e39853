# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.sequence.cross_entropy``: ds-parallel's ``vocab_sequence_parallel_cross_entropy``
(the Ulysses loss Megatron-DeepSpeed imports from here), under DeepSpeed's module path
(``from ds_all.sequence.cross_entropy import vocab_sequence_parallel_cross_entropy``)."""

from ds_parallel import vocab_sequence_parallel_cross_entropy

__all__ = ["vocab_sequence_parallel_cross_entropy"]
