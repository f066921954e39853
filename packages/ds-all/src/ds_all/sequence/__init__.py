# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.sequence``: Ulysses sequence parallelism and its loss, ds-parallel's, under DeepSpeed's module
path (``from ds_all.sequence.layer import DistributedAttention``)."""

from . import cross_entropy, layer  # noqa: F401
