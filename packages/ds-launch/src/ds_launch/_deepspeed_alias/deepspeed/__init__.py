"""``deepspeed`` as an alias of ``ds_all``, for one launch (``ds-launch --deepspeed_alias``).

ds-launch puts the folder above this package first on the ranks' PYTHONPATH. ``import deepspeed``
then gives the ``ds_all`` module itself, and ``deepspeed.X.Y`` gives ``ds_all.X.Y``, imported when
first asked for (one module object under both names, never a second copy). No distribution
metadata comes with it: ``importlib.metadata.version("deepspeed")`` still says DeepSpeed is not
installed, so pip and version checks are not fooled.

This file runs only in the ranks; ds-launch itself never imports it nor ds_all (whose name is
held in a variable below, not written in an import statement). The finder is ds-launch's
`ds_launch.alias_finder.AliasFinder`, which ds_all.hf.trainer uses too.
"""

import importlib
import importlib.machinery
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


def _install():
    _refuse_a_real_deepspeed()
    try:
        target = importlib.import_module(_TARGET)
    except ModuleNotFoundError as e:
        if e.name != _TARGET:
            raise
        raise ModuleNotFoundError(f"{_FLAG}: `import deepspeed` maps to ds_all, which is not installed in "
                                  f"{sys.executable}: pip install ds-all", name=_ALIAS) from None
    # ds-launch's finder, installed with ds_all (ds-all depends on ds-launch)
    from ds_launch.alias_finder import AliasFinder

    if not any(getattr(finder, "ds_launch_alias", False) for finder in sys.meta_path):
        finder = AliasFinder(_ALIAS, _TARGET)
        finder.ds_launch_alias = True  # this launch's, found again by a second import of this package
        sys.meta_path.insert(0, finder)  # before the path finder, which would load a second copy
    sys.modules[_ALIAS] = target  # what `import deepspeed` returns


_install()
