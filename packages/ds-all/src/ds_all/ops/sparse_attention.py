# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.ops.sparse_attention`` is ds-ops' block-sparse attention."""

from ds_ops.sparse_attention import *  # noqa: F403
from ds_ops.sparse_attention import __all__  # noqa: F401
