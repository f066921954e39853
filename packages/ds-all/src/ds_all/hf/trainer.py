"""A Hugging Face ``Trainer`` script runs on ds: add ``import ds_all.hf.trainer`` as its first import.

    import ds_all.hf.trainer  # isort: skip  (the one changed line: before transformers and accelerate)
    from transformers import Trainer, TrainingArguments
    args = TrainingArguments(..., deepspeed="ds_config.json")   # "auto" values filled by the Trainer
    Trainer(model=model, args=args, ...).train()

What the Trainer needs, and why this seam. Transformers (5.x) and Accelerate (1.x) never call a
DeepSpeed function through a plugin interface: they ``import deepspeed`` (and ``deepspeed.comm``,
``deepspeed.utils``, ``deepspeed.ops.adam``, ``deepspeed.runtime.lr_schedules``,
``deepspeed.runtime.zero.partition_parameters``, ``deepspeed.checkpoint.utils``) where they use it, and they
decide whether DeepSpeed is there *at import time* with ``importlib.util.find_spec("deepspeed")`` plus
``importlib.metadata.metadata("deepspeed")`` (a folder named ``deepspeed`` is not enough), and Accelerate
compares ``importlib.metadata.version("deepspeed")`` with minimum versions. So no public hook exists
short of being importable as ``deepspeed`` *with* distribution metadata. ``ds-launch --deepspeed_alias``
gives the import but deliberately no metadata (it lasts for a launch, reaches every process through
PYTHONPATH, and must not fool pip); the Trainer then sees no DeepSpeed. Patching Transformers' or
Accelerate's functions instead would tie ds to private names of two fast-moving libraries.

This module, imported once in the training process (nothing installed, nothing written, no other
process affected), therefore:

* makes ``deepspeed`` the ``ds_all`` module itself and ``deepspeed.X`` the module ``ds_all.X`` (one module
  object under both names, as ``ds-launch --deepspeed_alias`` does);
* adds, for this process only, a distribution named ``deepspeed`` whose version is the DeepSpeed API
  version ds follows (`DEEPSPEED_API_VERSION`) and whose summary says it is ds-all: Transformers'
  and Accelerate's checks pass, ``pip`` (another process) still sees no DeepSpeed;
* refuses (``ImportError``) where a real DeepSpeed is importable or already imported (the alias would
  hide it), and (``RuntimeError``) where ``transformers.integrations.deepspeed`` or Accelerate were
  imported first: they recorded "no DeepSpeed" then, so the line must come before them.

The Trainer then runs its DeepSpeed path on ds: ``deepspeed.initialize`` from Accelerate with the
config whose ``"auto"`` values the Trainer filled, ``zero.Init`` and ``GatheredParameters`` for ZeRO-3
models built under ``HfDeepSpeedConfig``, ``engine.save_checkpoint``/``load_checkpoint`` for the
Trainer's checkpoints, and ``deepspeed.utils.zero_to_fp32`` for the export.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import os
import pathlib
import sys
from typing import Any

import ds_all
from ds_launch.alias_finder import AliasFinder

from .._version import DEEPSPEED_API_VERSION

__all__ = ["DEEPSPEED_API_VERSION", "install"]

"""The DeepSpeed release whose API ds follows: the version ``importlib.metadata.version("deepspeed")``
reports in this process."""

_ALIAS = "deepspeed"
_TARGET = "ds_all"
_WHO = "ds_all.hf.trainer"
# Imported before this module, they decided at import time that DeepSpeed is not installed.
_TOO_LATE = ("transformers.integrations.deepspeed", "transformers.trainer", "accelerate.utils.imports",
             "accelerate.state")


def _metadata_text() -> str:
    return (f"Metadata-Version: 2.1\nName: {_ALIAS}\nVersion: {DEEPSPEED_API_VERSION}\n"
            f"Summary: ds-all {ds_all.__ds_version__} standing in for DeepSpeed {DEEPSPEED_API_VERSION}'s API in this "
            f"process only ({_WHO}); DeepSpeed itself is not installed\n"
            "Author: ds\nLicense: see ds-all\n\n")


class _Distribution(importlib.metadata.Distribution):
    """The in-process ``deepspeed`` distribution: metadata only (no files, no entry points)."""

    def read_text(self, filename: str) -> str | None:
        return _metadata_text() if filename == "METADATA" else None

    def locate_file(self, path: Any) -> Any:
        return pathlib.Path(os.path.dirname(ds_all.__file__)) / str(path)


def _is_deepspeed(name: str | None) -> bool:
    return name is not None and name.lower().replace("-", "_").replace(".", "_") == _ALIAS


class _Finder(AliasFinder):
    """``deepspeed.X`` is ``ds_all.X`` (the module itself, ds-launch's finder); ``deepspeed``'s distribution
    metadata."""

    ds_all_hf_trainer = True

    def __init__(self) -> None:
        super().__init__(_ALIAS, _TARGET)

    def find_distributions(self, context: Any = None) -> list:
        name = getattr(context, "name", None)
        return [_Distribution()] if name is None or _is_deepspeed(name) else []


def _is_launch_alias(origin: str | None) -> bool:
    """``ds-launch --deepspeed_alias``'s package (``.../ds_launch/_deepspeed_alias/deepspeed``): ds_all too."""
    return origin is not None and os.path.basename(os.path.dirname(os.path.dirname(origin))) == "_deepspeed_alias"


def _refuse_a_real_deepspeed() -> None:
    present = sys.modules.get(_ALIAS)
    if present is not None and present is not ds_all:
        raise ImportError(f"{_WHO}: a real DeepSpeed is already imported ({getattr(present, '__file__', present)}); "
                          f"{_WHO} would hide it: remove the import of {_WHO} to train with DeepSpeed, or "
                          "uninstall deepspeed to train with ds", name=_ALIAS)
    if present is None:
        spec = importlib.machinery.PathFinder.find_spec(_ALIAS)
        if spec is not None and spec.origin is not None and not _is_launch_alias(spec.origin):
            raise ImportError(f"{_WHO}: a real DeepSpeed is installed ({spec.origin}) and {_WHO} would hide it: "
                              f"remove the import of {_WHO} to train with DeepSpeed, or uninstall deepspeed to "
                              "train with ds", name=_ALIAS)
    try:
        found = importlib.metadata.distribution(_ALIAS)
    except importlib.metadata.PackageNotFoundError:
        return
    if not isinstance(found, _Distribution):
        raise ImportError(f"{_WHO}: a deepspeed distribution {found.version} is installed (its metadata is at "
                          f"{getattr(found, '_path', '?')}); {_WHO} would hide it: uninstall deepspeed to train "
                          "with ds", name=_ALIAS)


def install() -> None:
    """Make ``deepspeed`` ds_all in this process (what importing this module does; a second call does
    nothing). Raises ``ImportError`` where a real DeepSpeed is importable, and ``RuntimeError`` where
    Transformers' Trainer or Accelerate was imported before (move the import of ds_all.hf.trainer up)."""
    if any(getattr(finder, "ds_all_hf_trainer", False) for finder in sys.meta_path):
        return
    _refuse_a_real_deepspeed()
    late = [name for name in _TOO_LATE if name in sys.modules]
    if late:
        raise RuntimeError(f"{_WHO} was imported after {', '.join(late)}, which already decided that DeepSpeed is "
                           f"not installed: put `import {_WHO}` before the imports of transformers and accelerate")
    sys.meta_path.insert(0, _Finder())  # before the path finder, which would load a second copy
    sys.modules[_ALIAS] = ds_all  # what `import deepspeed` returns


install()
