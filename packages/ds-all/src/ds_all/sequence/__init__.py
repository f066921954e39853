"""DeepSpeed's ``deepspeed.sequence``: Ulysses sequence parallelism and its loss, ds-parallel's, under DeepSpeed's module
path (``from ds_all.sequence.layer import DistributedAttention``)."""

from . import cross_entropy, layer  # noqa: F401
