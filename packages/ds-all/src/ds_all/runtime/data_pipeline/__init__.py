"""DeepSpeed's ``deepspeed.runtime.data_pipeline`` (the Data Efficiency library) is ds-data's: thin modules at
DeepSpeed's paths re-export its objects (``curriculum_scheduler``, ``data_routing``, ``data_sampling``). A name
DeepSpeed has at such a path that ds does not build is an ImportError naming it when imported, and so is
``data_sampling.variable_batch_size_and_lr`` as a whole."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from importlib.metadata import PackageNotFoundError, version


def _version() -> str:
    try:
        return version("ds-all")
    except PackageNotFoundError:  # a source tree without installed metadata
        return "(source tree)"


def not_built(module: str, names: Iterable[str], what: str) -> Callable[[str], object]:
    """A module ``__getattr__`` that refuses DeepSpeed's ``names`` of ``module`` (``from ... import name``
    raises an ImportError naming it and ``what`` it belongs to); any other name is the usual AttributeError."""
    refused = frozenset(names)

    def __getattr__(name: str) -> object:
        if name in refused:
            deepspeed_module = module.replace("ds_all.", "deepspeed.", 1)
            raise ImportError(f"{deepspeed_module}.{name} ({what}) is not implemented in ds-all {_version()}",
                              name=module)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
