# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.checkpoint`` paths that training libraries import: ``checkpoint.utils``
(``clone_tensors_for_torch_save``, which Accelerate calls on a gathered ZeRO-3 state dict)."""

from . import utils  # noqa: F401
