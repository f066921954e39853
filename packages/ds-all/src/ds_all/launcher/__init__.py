"""DeepSpeed's ``deepspeed.launcher``: its ``runner`` module (``parse_args``, ``main``) over ds-launch."""

from . import runner  # deepspeed.launcher.runner, an attribute as in DeepSpeed

__all__ = ["runner"]
