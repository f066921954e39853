"""ds-launch: DeepSpeed's launcher for ds, standard library only (it never imports torch).

Run ``ds-launch --help``. The public API is the command line (`main`) plus the pieces a program
may want to reuse: hostfile parsing and resource selection, and DeepSpeed's elastic batch-size
computation (`compute_elastic_config` and its errors), which elastic launches and the engine share, and
`parse_deepspeed_args`, the command line read as DeepSpeed's runner (``deepspeed.launcher.runner.parse_args``).
"""

__version__ = "0.1.0"

from ._deepspeed_args import parse_deepspeed_args
from ._elasticity import (
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
    compute_elastic_config,
)
from .cli import main
from .resources import LaunchError, parse_hostfile, select_resources

__all__ = ["ElasticityConfigError", "ElasticityError", "ElasticityIncompatibleWorldSize", "LaunchError", "__version__",
           "compute_elastic_config", "main", "parse_deepspeed_args", "parse_hostfile", "select_resources"]
