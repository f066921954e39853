# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""``ds_all.pipe`` is ds-pipe (DeepSpeed's ``deepspeed.pipe``): ``from ds_all.pipe import PipelineModule, LayerSpec``."""

from ds_pipe import *  # noqa: F403
from ds_pipe import __all__  # noqa: F401
