"""``deepspeed`` as an alias of ``ds_all``, for one launch (``ds-launch --deepspeed_alias``).

ds-launch puts the folder above this package first on the ranks' PYTHONPATH. ``import deepspeed``
then gives the ``ds_all`` module itself, and ``deepspeed.X.Y`` gives ``ds_all.X.Y``, imported when
first asked for (one module object under both names, never a second copy). No distribution
metadata comes with it: ``importlib.metadata.version("deepspeed")`` still says DeepSpeed is not
installed, so pip and version checks are not fooled.

This file runs only in the ranks; ds-launch itself never imports it nor ds_all (whose name is
held in a variable below, not written in an import statement).
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_ALIAS = __name__  # "deepspeed"
_TARGET = "ds_all"
_FLAG = "ds-launch --deepspeed_alias"


def _refuse_a_real_deepspeed() -> None:
    """ds-launch checked before starting; this checks again on this node, for this rank."""
    here = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    others = [p for p in sys.path if os.path.realpath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec(_ALIAS, others)
    if spec is not None and spec.origin is not None:
        raise ImportError(f"{_FLAG}: a real DeepSpeed is installed ({spec.origin}) and the alias would hide it; "
                          "run without --deepspeed_alias", name=_ALIAS)


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``deepspeed.X`` as ``ds_all.X`` and hands out the ``ds_all.X`` module itself."""

    ds_launch_alias = True

    def __init__(self) -> None:
        self._real_specs = {}

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(_ALIAS + "."):
            return None
        try:
            real = importlib.util.find_spec(_TARGET + fullname[len(_ALIAS):])
        except ModuleNotFoundError:
            return None
        if real is None:
            return None  # Python says "No module named 'deepspeed.X'"
        return importlib.machinery.ModuleSpec(fullname, self, is_package=real.submodule_search_locations is not None)

    def create_module(self, spec):
        module = importlib.import_module(_TARGET + spec.name[len(_ALIAS):])
        self._real_specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module):
        # The import system has just set the module's __spec__ to the alias's: give it back its own,
        # so ds_all.X keeps its identity (reload, pickling by reference, multiprocessing's spawn).
        alias = module.__spec__.name
        module.__spec__ = self._real_specs.pop(alias)


def _install():
    _refuse_a_real_deepspeed()
    try:
        target = importlib.import_module(_TARGET)
    except ModuleNotFoundError as e:
        if e.name != _TARGET:
            raise
        raise ModuleNotFoundError(f"{_FLAG}: `import deepspeed` maps to ds_all, which is not installed in "
                                  f"{sys.executable}: pip install ds-all", name=_ALIAS) from None
    if not any(getattr(finder, "ds_launch_alias", False) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())  # before the path finder, which would load a second copy
    sys.modules[_ALIAS] = target  # what `import deepspeed` returns


_install()
