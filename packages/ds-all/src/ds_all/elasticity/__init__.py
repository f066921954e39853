"""DeepSpeed's ``deepspeed.elasticity``: the elastic batch-size computation (ds-launch's, standard library
only), its errors, and the ``elasticity`` section's model."""

from ds_launch import (
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
    compute_elastic_config,
)

from ._elasticity import ElasticityConfig, elasticity_enabled

__all__ = ["ElasticityConfig", "ElasticityConfigError", "ElasticityError", "ElasticityIncompatibleWorldSize",
           "compute_elastic_config", "elasticity_enabled"]
