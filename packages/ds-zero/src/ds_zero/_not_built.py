"""What ds-zero knows of DeepSpeed's ``zero_optimization`` but has not built: refused by name when turned on."""

from __future__ import annotations

from ._model import version
from .config import ZeroConfig

# Keys of zero_optimization this version accepts but cannot honour yet, and why.
_NOT_YET = {
    "mics_shard_size": (-1, "MiCS"),
    "mics_hierarchical_params_gather": (False, "MiCS"),
    "legacy_stage1": (False, "DeepSpeed's legacy stage 1"),
}


def refuse_what_is_not_built(config: ZeroConfig) -> None:
    """Keys ds-zero knows but has not built, turned on: NotImplementedError naming each (before any collective)."""
    if config.offload_param is not None and config.offload_param.device == "nvme" and \
            (config.offload_optimizer is None or config.offload_optimizer.device != "nvme"):
        raise NotImplementedError("zero_optimization.offload_param.device 'nvme' needs offload_optimizer.device "
                                  f"'nvme' too in ds-zero {version()} (the optimizer step reads and writes the "
                                  "parameters where they are)")
    offload = config.offload_optimizer
    if offload is not None and offload.device == "cpu" and offload.ratio != 1.0:
        raise NotImplementedError(f"zero_optimization.offload_optimizer.ratio {offload.ratio:g} (partial offload) "
                                  f"is not implemented in ds-zero {version()}; use 1.0")
    if offload is not None and offload.super_offload:
        raise NotImplementedError("zero_optimization.offload_optimizer.super_offload (DeepSpeed's SuperOffload for "
                                  f"Superchips) is not implemented in ds-zero {version()}; remove it or set it to "
                                  "false")
    for key, (default, what) in _NOT_YET.items():
        if getattr(config, key) != default:
            raise NotImplementedError(f"zero_optimization.{key} ({what}) is not implemented in ds-zero; "
                                      f"remove it or set it to {default!r}")
    if config.reduce_bucket_size == "auto":
        raise ValueError('zero_optimization.reduce_bucket_size is "auto": resolve it to a number of '
                         "elements first (the engine does this from the model)")
