"""An import alias: ``<alias>.X`` is the module ``<target>.X`` itself (one module object under both names,
never a second copy), imported when first asked for. Standard library only.

ds-launch's ``--deepspeed_alias`` package and ``ds_all.hf.trainer`` both make ``deepspeed`` an alias of
``ds_all`` with it; each puts an instance first on ``sys.meta_path`` (before the path finder, which would
load a second copy) and sets ``sys.modules[alias]`` to the target package itself.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
from typing import Any

__all__ = ["AliasFinder"]


class AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``<alias>.X`` as ``<target>.X`` and hands out the ``<target>.X`` module itself."""

    def __init__(self, alias: str, target: str) -> None:
        if not (alias.isidentifier() and target.isidentifier()):
            raise ValueError(f"AliasFinder: alias and target must be top-level module names, got {alias!r} and "
                             f"{target!r}")
        self.alias, self.target = alias, target
        self._real_specs: dict[str, Any] = {}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if not fullname.startswith(self.alias + "."):
            return None
        try:
            real = importlib.util.find_spec(self.target + fullname[len(self.alias):])
        except ModuleNotFoundError:
            return None
        if real is None:
            return None  # Python then says "No module named '<alias>.X'"
        return importlib.machinery.ModuleSpec(fullname, self, is_package=real.submodule_search_locations is not None)

    def create_module(self, spec: Any) -> Any:
        module = importlib.import_module(self.target + spec.name[len(self.alias):])
        self._real_specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: Any) -> None:
        # The import system has just given the module the alias's spec: give it back its own, so
        # <target>.X keeps its identity (reload, pickling by reference, multiprocessing's spawn).
        module.__spec__ = self._real_specs.pop(module.__spec__.name)
