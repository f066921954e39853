"""Extract DeepSpeed's importable module paths and the names each module binds at its top level, once, from
an installed DeepSpeed (its source files, read with ``ast``; nothing is imported), into the compact JSON
fixture ``tests/fixtures/deepspeed_module_tree.json`` that ``tests/test_deepspeed_names_table.py`` checks the
table of DeepSpeed's names (``ds_all/_deepspeed_paths.py``) against.

    python packages/ds-all/scripts/extract_deepspeed_tree.py /work/dsref/lib/python3.11/site-packages/deepspeed

A module's names are those its top level binds (classes, functions, assignments, imports of DeepSpeed's own
modules and names, the public names of a ``from .x import *`` of another DeepSpeed module, in every branch of
a top-level ``if``/``try``), dunders left out (imports from torch, typing and the like are not DeepSpeed's API); a package's submodules are attributes too once imported, and are listed as modules.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "deepspeed_module_tree.json"


def module_paths(root: Path) -> dict[str, Path]:
    """Dotted path below ``deepspeed`` ("" for the package itself) -> its file."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = list(rel.parts)
        if "__pycache__" in parts or not all(p.isidentifier() for p in parts):
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _targets(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [n for e in node.elts for n in _targets(e)]
    if isinstance(node, ast.Starred):
        return _targets(node.value)
    return []


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str | None:
    """The dotted path below ``deepspeed`` of an import, or None when it is outside DeepSpeed."""
    if level == 0:
        if name is None or not (name == "deepspeed" or name.startswith("deepspeed.")):
            return None
        return name[len("deepspeed."):] if name != "deepspeed" else ""
    parts = module.split(".") if module else []
    base = parts if is_package else parts[:-1]
    base = base[:len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, *(name.split(".") if name else [])])


def bound_names(body: list[ast.stmt], module: str, is_package: bool, stars: list[str]) -> set[str]:
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(n for t in node.targets for n in _targets(t))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            names.update(_targets(node.target))
        elif isinstance(node, ast.Import):  # only DeepSpeed's own modules: `import torch` is no name of its API
            names.update(a.asname or a.name.split(".")[0] for a in node.names
                         if _resolve(module, is_package, 0, a.name) is not None)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, is_package, node.level, node.module)
            if target is None:
                continue  # from typing/torch/...: not DeepSpeed's API
            for alias in node.names:
                if alias.name == "*":
                    stars.append(target)
                else:
                    names.add(alias.asname or alias.name)
        elif isinstance(node, ast.If):
            names |= bound_names(node.body, module, is_package, stars) | bound_names(node.orelse, module,
                                                                                     is_package, stars)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                names |= bound_names(block, module, is_package, stars)
        elif isinstance(node, (ast.With, ast.For, ast.While)):
            names |= bound_names(node.body, module, is_package, stars)
    return names


def extract(root: Path) -> dict[str, list[str]]:
    paths = module_paths(root)
    direct: dict[str, set[str]] = {}
    stars: dict[str, list[str]] = {}
    for module, path in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        stars[module] = []
        direct[module] = bound_names(tree.body, module, path.name == "__init__.py", stars[module])

    def names_of(module: str, seen: frozenset[str] = frozenset()) -> set[str]:
        result = set(direct.get(module, ()))
        for star in stars.get(module, ()):
            if star in direct and star not in seen:  # a star import exports the public names
                result |= {n for n in names_of(star, seen | {module}) if not n.startswith("_")}
        return result

    return {module: sorted(n for n in names_of(module) if not re.fullmatch(r"__\w+__", n)) for module in paths}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("deepspeed_dir", type=Path, help="the installed package's folder (.../site-packages/deepspeed)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    version = re.search(r"^version\s*=\s*['\"]([^'\"]+)", (args.deepspeed_dir / "git_version_info_installed.py")
                        .read_text(), re.M)
    modules = extract(args.deepspeed_dir)
    payload = {"deepspeed": version.group(1) if version else "unknown",
               "how": "packages/ds-all/scripts/extract_deepspeed_tree.py (ast over the installed source files)",
               "modules": {m: " ".join(names) for m, names in sorted(modules.items())}}
    text = json.dumps(payload, indent=0, sort_keys=False) + "\n"
    args.out.write_text(text)
    print(f"{len(modules)} modules, {sum(map(len, modules.values()))} names -> {args.out} ({len(text)} bytes)",
          file=sys.stderr)


if __name__ == "__main__":
    main()
