# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.launcher``: its ``runner`` module (``parse_args``, ``main``) over ds-launch."""

from . import runner

__all__ = ["runner"]
