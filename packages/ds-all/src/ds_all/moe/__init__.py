# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.moe``: ds-moe's Mixture of Experts under DeepSpeed's module paths
(``from ds_all.moe.layer import MoE``, ``ds_all.moe.sharded_moe``, ``ds_all.moe.experts``, ``ds_all.moe.utils``)."""

from . import experts, layer, sharded_moe, utils  # noqa: F401
