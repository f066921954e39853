"""Finding and setting a key anywhere in a nested config dict (DeepSpeed's ``get_val_by_key`` and
``set_val_by_key``): ``arg_mappings`` name a key such as ``stage`` that lives inside ``zero_optimization``."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any


def get_val_by_key(d: Mapping, k: Any) -> Any:
    """The value of key ``k`` in ``d`` or in any dict nested in it, depth first in insertion order (``d``'s
    own key first); None when no level has the key."""
    if not isinstance(d, Mapping):
        raise ValueError(f"get_val_by_key needs a dict to search, got {type(d).__name__} {d!r}")
    return _get(d, k)


def _get(d: Mapping, k: Any) -> Any:
    if k in d:
        return d[k]
    for value in d.values():
        if isinstance(value, Mapping):
            found = _get(value, k)
            if found is not None:
                return found
    return None


def set_val_by_key(d: MutableMapping, k: Any, vv: Any) -> None:
    """Set key ``k`` to ``vv`` wherever it occurs in ``d`` and the dicts nested in it (every level; a key
    that occurs nowhere is not added). The new value itself is not searched: ``vv`` holding ``k`` would
    otherwise be put inside itself."""
    if not isinstance(d, MutableMapping):
        raise ValueError(f"set_val_by_key needs a dict to update, got {type(d).__name__} {d!r}")
    _set(d, k, vv)


def _set(d: MutableMapping, k: Any, vv: Any) -> None:
    if k in d:
        d[k] = vv
    for key, value in d.items():
        if isinstance(value, MutableMapping) and not (key == k and value is vv):
            _set(value, k, vv)
