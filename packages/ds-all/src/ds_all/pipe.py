"""``ds_all.pipe`` is ds-pipe (DeepSpeed's ``deepspeed.pipe``): ``from ds_all.pipe import PipelineModule, LayerSpec``."""

from ds_pipe import *  # noqa: F403  (the same public names)
from ds_pipe import __all__  # noqa: F401
