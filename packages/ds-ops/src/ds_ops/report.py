"""``ds-report``: what this machine offers ds's native ops, like DeepSpeed's ``ds_report``.

Versions (Python, torch, the ds packages), compiler, ninja, SIMD level, the op cache, and a table
of every op (ds-ops' and those other packages register under the ``ds_ops.builders`` entry
point, e.g. ds-io's) with whether it can be built here, whether it is built, and why not.
"""

from __future__ import annotations

import argparse
import platform
import sys
from importlib import metadata

from .op_builder import BUILDERS, OpBuilder, cache_root, system


def all_builders() -> dict[str, type[OpBuilder]]:
    """ds-ops' builders and those of installed packages (entry-point group ``ds_ops.builders``)."""
    found = dict(BUILDERS)
    for entry in metadata.entry_points(group="ds_ops.builders"):
        if entry.name in found:
            continue
        try:
            found[entry.name] = entry.load()
        except Exception as e:  # a broken plugin is reported, not fatal
            print(f"warning: cannot load op builder {entry.name} ({entry.value}): {e}", file=sys.stderr)
    return found


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def report(build: bool = False) -> str:
    import torch

    cxx = system.compiler()
    lines = ["ds-report: native ops of ds", "-" * 72]
    rows = [("python", f"{platform.python_version()} ({sys.executable})"),
            ("torch", f"{torch.__version__} (cuda: {torch.version.cuda or 'none'}, "
                      f"available: {torch.cuda.is_available()})"),
            *((name, _version(name)) for name in ("ds-ops", "ds-io", "ds-comm", "ds-all")),
            ("compiler", f"{cxx} — {system.compiler_version(cxx)}" if cxx else "none found (install g++)"),
            ("ninja", system.ninja() or "not found (pip install ninja)"),
            ("pybind11", str(system.pybind11_include() or "not found (pip install pybind11)")),
            ("SIMD", f"{system.simd_choice()} → {OpBuilder().simd_level() if cxx else 'unknown'}"),
            ("op cache", str(cache_root()))]
    lines += [f"{name:<10} {value}" for name, value in rows]
    lines += ["-" * 72, f"{'op':<14}{'compatible':<12}{'built':<8}note", "-" * 72]
    for name, cls in sorted(all_builders().items()):
        builder = cls()
        ok, reason = builder.compatibility()
        if ok and build:
            try:
                builder.load()
            except Exception as e:
                reason = f"build failed: {str(e).splitlines()[0]}"
        built = "yes" if ok and builder.is_built() else "no"
        note = reason or builder.DESCRIPTION
        lines.append(f"{name:<14}{'yes' if ok else 'NO':<12}{built:<8}{note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ds-report", description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="store_true", help="build every compatible op that is not built yet")
    args = parser.parse_args(argv)
    print(report(build=args.build))
    return 0


if __name__ == "__main__":
    sys.exit(main())
