# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.elasticity.config``: the elasticity errors and the section's model."""

from ds_launch import ElasticityConfigError, ElasticityError, ElasticityIncompatibleWorldSize

from .._elasticity import ElasticityConfig

__all__ = ["ElasticityConfig", "ElasticityConfigError", "ElasticityError",
           "ElasticityIncompatibleWorldSize"]
