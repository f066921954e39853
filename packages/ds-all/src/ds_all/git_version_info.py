"""DeepSpeed's ``deepspeed.git_version_info``: what the build recorded about itself.

``version`` is the DeepSpeed API version ds-all follows (as ``deepspeed.__version__``); ``ds_version`` is
ds-all's own. ``installed_ops`` says which ops are built ahead (ds-ops builds the rest just in time);
``torch_info`` the torch this process runs (DeepSpeed records the one it was built with, "0.0" when none).
"""

from __future__ import annotations

import torch

from ds_ops import get_accelerator

from ._version import DEEPSPEED_API_VERSION, DS_VERSION

version = DEEPSPEED_API_VERSION
ds_version = DS_VERSION
git_hash = "[none]"
git_branch = "[none]"


def _major_minor(text: str | None) -> str:
    return ".".join(text.split("+")[0].split(".")[:2]) if text else "0.0"


def _nccl() -> str:
    if not torch.cuda.is_available():
        return "0.0"
    major, minor, *_ = torch.cuda.nccl.version()
    return f"{major}.{minor}"


torch_info = {
    "version": _major_minor(torch.__version__),
    "bf16_support": bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()),
    "cuda_version": _major_minor(torch.version.cuda),
    "nccl_version": _nccl(),
    "hip_version": _major_minor(getattr(torch.version, "hip", None)),
}
accelerator_name = get_accelerator().device_name()


def __getattr__(name: str):
    if name == "installed_ops":  # whether each op is built ahead: a look at the op cache, on first access
        from ds_ops.report import all_builders

        globals()[name] = {op: builder().is_built() for op, builder in all_builders().items()}
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
