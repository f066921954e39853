"""DeepSpeed's ``deepspeed.ops`` is ds-ops; its submodules under DeepSpeed's names (``ds_all.ops.adam`` ...)."""

from ds_ops import *  # noqa: F403  (the same public names)
from ds_ops import __all__  # noqa: F401

from . import adagrad, adam, lamb, lion, op_builder, sparse_attention  # noqa: F401
