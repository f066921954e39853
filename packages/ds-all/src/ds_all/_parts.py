"""The packages ds-all is made of, read from its own distribution metadata."""

from __future__ import annotations

import re
from importlib import metadata


def _declared_parts() -> tuple[str, ...]:
    requirements = metadata.requires("ds-all") or []
    names = (re.match(r"[A-Za-z0-9_.\-]+", r).group(0) for r in requirements if "extra ==" not in r)
    return tuple(n for n in names if n.startswith("ds-"))


PARTS: tuple[str, ...] = _declared_parts()


def versions() -> dict[str, str]:
    """Installed version of ds-all and of each part it depends on (``"missing"`` if absent)."""
    out = {"ds-all": metadata.version("ds-all")}
    for name in PARTS:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "missing"
    return out
