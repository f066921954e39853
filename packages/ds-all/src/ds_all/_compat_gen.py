"""Write the modules at DeepSpeed's paths that only re-export (``ds_all/<path>.py``) from the one table,
``ds_all/_deepspeed_paths.py``; the files are real, so mypy, IDEs, tracebacks and ``pip show -f`` see them.

    python -m ds_all._compat_gen           # (re)write every generated file
    python -m ds_all._compat_gen --check   # exit 1 naming each file that differs from the table

Standard library only; nothing here is imported by ``ds_all`` itself.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ._deepspeed_paths import DEEPSPEED, Module

PACKAGE = Path(__file__).resolve().parent
TABLE = "ds_all/_deepspeed_paths.py"
HEADER = f"# generated from {TABLE} by `python -m ds_all._compat_gen`; do not edit\n"
NOT_BUILT = "ds_all.runtime.data_pipeline:not_built"
WIDTH = 100


def is_package(path: str) -> bool:
    return any(other.startswith(path + ".") for other in DEEPSPEED)


def file_of(path: str) -> Path:
    """The file of ``ds_all.<path>``, relative to the ``ds_all`` folder."""
    parts = path.split(".")
    return Path(*parts, "__init__.py") if is_package(path) else Path(*parts[:-1], parts[-1] + ".py")


def _relative(path: str, module: str) -> str:
    """``module`` (a ``ds_all`` module) as a relative import from ``ds_all.<path>``."""
    here = ["ds_all", *path.split(".")]
    package = here if is_package(path) else here[:-1]
    target = module.split(".")
    common = 0
    while common < min(len(package), len(target)) and package[common] == target[common]:
        common += 1
    return "." * (len(package) - common + 1) + ".".join(target[common:])


def _name_key(name: str) -> tuple[int, str, str]:
    """isort's order-by-type: CONSTANTS, then Classes, then the rest."""
    kind = 0 if name.isupper() and len(name) > 1 else 1 if name[:1].isupper() else 2
    return kind, name.lower(), name


def _all_key(name: str) -> tuple[int, str]:
    """ruff's isort-style order of ``__all__`` (RUF022): by type, then case-sensitively."""
    return _name_key(name)[0], name


def _from(module: str, names: list[str], comment: str = "") -> str:
    members = sorted(names, key=_name_key)
    line = f"from {module} import {', '.join(members)}"
    if len(line) <= WIDTH:
        return line + (f"  {comment}" if comment else "")
    return (f"from {module} import (" + (f"  {comment}" if comment else "") + "\n"
            + "".join(f"    {m},\n" for m in members) + ")")


def _wrapped(head: str, items: list[str], tail: str, indent: int) -> str:
    """``head`` + items joined by ", " + ``tail``, wrapped at WIDTH with continuation lines at ``indent``."""
    lines, current = [], head
    for i, item in enumerate(items):
        piece = item + (", " if i < len(items) - 1 else tail)
        if len(current) + len(piece.rstrip()) > WIDTH and current.strip() not in ("", head.strip()):
            lines.append(current.rstrip())
            current = " " * indent
        current += piece
    lines.append(current.rstrip())
    return "\n".join(lines)


def render(path: str, module: Module) -> str:
    """The source of ``ds_all.<path>`` as the table gives it."""
    if module.hand or module.doc is None:
        raise ValueError(f"{path} is hand-written; only re-export modules are generated")
    absolute_imports: list[tuple[str, str]] = []  # (module, statement)
    absolute_from: dict[str, list[str]] = {}  # module -> plain names
    absolute_alias: list[tuple[str, str]] = []  # (module, "attr as name")
    relative: dict[str, list[str]] = {}
    relative_alias: list[tuple[str, str]] = []
    submodules = list(module.submodules.split())
    own_package = f"ds_all.{path}"
    for name, owner in module.names.items():
        if ":" not in owner:  # a module object
            if owner == f"{own_package}.{name}":
                submodules.append(name)
            elif owner.startswith("ds_all"):
                raise ValueError(f"{path}.{name}: a ds_all module other than a submodule, {owner}")
            else:
                absolute_imports.append((owner, f"import {owner}" + (f" as {name}" if name != owner else "")))
            continue
        source, attr = owner.split(":")
        if source.startswith("ds_all"):
            source = _relative(path, source)
            if attr == name:
                relative.setdefault(source, []).append(name)
            else:
                relative_alias.append((source, f"{attr} as {name}"))
        elif attr == name:
            absolute_from.setdefault(source, []).append(name)
        else:
            absolute_alias.append((source, f"{attr} as {name}"))
    stars = []
    if module.star:
        source = _relative(path, module.star) if module.star.startswith("ds_all") else module.star
        stars = [f"from {source} import *  # noqa: F403", f"from {source} import __all__  # noqa: F401"]
    if module.refused:
        source, attr = NOT_BUILT.split(":")
        relative.setdefault(_relative(path, source), []).append(attr)

    def from_statements(plain: dict[str, list[str]], aliased: list[tuple[str, str]]) -> list[str]:
        statements: list[tuple[tuple, str]] = []
        for source, names in plain.items():
            statements.append(((source, _name_key(sorted(names, key=_name_key)[0])), _from(source, names)))
        for source, member in aliased:
            statements.append(((source, _name_key(member.split()[0])), f"from {source} import {member}"))
        return [s for _, s in sorted(statements, key=lambda item: item[0])]

    first_party = [s for _, s in sorted(absolute_imports)] + from_statements(absolute_from, absolute_alias)
    if stars and not module.star.startswith("ds_all"):
        first_party += stars
    if submodules:
        relative[". "] = submodules  # sorts as "from . import", before ".x"
    exported_submodules = set(submodules) & set(module.names)
    local = []
    for source in sorted(relative, key=lambda s: (-(len(s) - len(s.lstrip("."))), s.strip())):
        names = relative[source]
        comment = "# noqa: F401" if source == ". " and not exported_submodules else ""
        local.append(_from(source.strip(), names, comment))
    local += from_statements({}, relative_alias)
    if stars and module.star.startswith("ds_all"):
        local = stars + local

    out = [HEADER + f'"""{module.doc}"""\n']
    sections = [section for section in (first_party, local) if section]
    if sections:
        out.append("\n\n".join("\n".join(section) for section in sections) + "\n")
    if module.constants:
        out.append("".join(f"{name} = {value!r}\n".replace("'", '"') for name, value in module.constants.items()))
    exported = sorted([*module.names, *module.constants], key=_all_key)
    if exported and not module.star:
        out.append(_wrapped("__all__ = [", [f'"{n}"' for n in exported], "]", 11) + "\n")
    elif module.refused and not module.star:
        out.append("__all__: list[str] = []\n")
    if module.refused:
        names, what = module.refused
        head = "__getattr__ = not_built(__name__, ("
        refused = _wrapped(head, [f'"{n}"' for n in names.split()], ",)," if len(names.split()) == 1 else "),",
                           len(head))
        out.append(refused + f'\n{" " * 24}"{what}")\n' if len(refused.splitlines()[-1]) + len(what) + 4 > WIDTH
                   else refused + f' "{what}")\n')
    return "\n".join(out)


def generated() -> dict[Path, str]:
    """Every generated file (relative to the ``ds_all`` folder) -> its text."""
    return {file_of(path): render(path, module) for path, module in DEEPSPEED.items() if not module.hand}


def drift(root: Path = PACKAGE) -> list[str]:
    """The generated files under ``root`` whose text differs from the table's, or that are missing."""
    problems = []
    for relative, text in generated().items():
        target = root / relative
        if not target.exists():
            problems.append(f"ds_all/{relative.as_posix()}: missing (the table lists it)")
        elif target.read_text(encoding="utf-8") != text:
            problems.append(f"ds_all/{relative.as_posix()}: differs from {TABLE} (edit the table, then run "
                            "python -m ds_all._compat_gen)")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_all._compat_gen", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 on drift")
    args = parser.parse_args(argv)
    if args.check:
        problems = drift()
        print("\n".join(problems) or f"{len(generated())} generated files match {TABLE}")
        return 1 if problems else 0
    for relative, text in generated().items():
        target = PACKAGE / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists() or target.read_text(encoding="utf-8") != text:
            target.write_text(text, encoding="utf-8")
            print(f"wrote ds_all/{relative.as_posix()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
