# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.autotuning``: the autotuner (ds-autotune's) at DeepSpeed's paths: ``autotuner``
(``Autotuner(args, active_resources)``), ``scheduler`` (``ResourceManager``) and ``utils``
(``get_val_by_key``, ``set_val_by_key``)."""

from . import scheduler, utils  # noqa: F401
from .autotuner import Autotuner

__all__ = ["Autotuner"]
