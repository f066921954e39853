# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.elasticity``: the elastic batch-size computation (ds-launch's, standard library
only), its errors, and the ``elasticity`` section's model. ``ds_all.elasticity.config`` is DeepSpeed's
``deepspeed.elasticity.config`` (where DeepSpeed's scripts and tests find the errors)."""

from ds_launch import (
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
    compute_elastic_config,
)

from .._elasticity import ElasticityConfig, elasticity_enabled
from . import config  # noqa: F401

__all__ = ["ElasticityConfig", "ElasticityConfigError", "ElasticityError",
           "ElasticityIncompatibleWorldSize", "compute_elastic_config", "elasticity_enabled"]
