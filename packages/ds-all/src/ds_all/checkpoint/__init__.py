"""DeepSpeed's ``deepspeed.checkpoint`` paths that training libraries import: ``checkpoint.utils``
(``clone_tensors_for_torch_save``, which Accelerate calls on a gathered ZeRO-3 state dict)."""

from . import utils  # noqa: F401
