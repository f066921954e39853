"""The repository's packages, as the noxfile tests and builds them: derived from ``packages/*/pyproject.toml``,
never listed by hand, and ordered by the layer table of ``packages/ds-all/tests/test_layering.py`` (``LAYERS``,
lower layers first), so that one pip command can install them together and a package added, renamed or
misspelt is either tested or fails the run with its name.

Standard library and ``packaging`` only (nox depends on it, and so does pytest): the noxfile and
``packages/ds-all/tests/test_repo_packages.py`` import it from here.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

LAYERING_TEST = Path("packages") / "ds-all" / "tests" / "test_layering.py"


class PackageError(ValueError):
    """The package folders, their pyproject.toml files and the layer table disagree."""


def layers(root: Path) -> dict[str, int]:
    """``LAYERS`` of the layering test ({module name: layer}), read from its source (a literal dict)."""
    path = root / LAYERING_TEST
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "LAYERS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise PackageError(f"{path}: no literal LAYERS = {{...}} to order the packages by")


def _project(folder: Path) -> dict:
    pyproject = folder / "pyproject.toml"
    if not pyproject.is_file():
        raise PackageError(f"{folder}: a folder under packages/ without a pyproject.toml (a misspelt or "
                           "half-moved package? every folder there is a package)")
    try:
        return tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    except (tomllib.TOMLDecodeError, KeyError) as e:
        raise PackageError(f"{pyproject}: not a readable [project] table ({e})") from None


def requirement_names(requirements: list[str], where: str) -> list[str]:
    """The canonical project names of PEP 508 requirement strings (markers, extras and ``~=`` included)."""
    names = []
    for text in requirements:
        try:
            names.append(canonicalize_name(Requirement(text).name))
        except InvalidRequirement as e:
            raise PackageError(f"{where}: requirement {text!r} is not PEP 508 ({e})") from None
    return names


def packages(root: Path) -> list[str]:
    """Every package of the repository (its folder name, which is its project name), lower layers first.

    Refused, naming what is wrong: a folder without a pyproject.toml, a folder named other than its
    project, a package the layer table lacks or a table entry without a folder, a package that depends
    on one of ours of a higher layer, and a dependency cycle."""
    table = layers(root)
    folders = sorted(p for p in (root / "packages").iterdir() if p.is_dir() and not p.name.startswith("."))
    found: dict[str, dict] = {}
    problems = []
    for folder in folders:
        try:
            project = _project(folder)
        except PackageError as e:
            problems.append(str(e))
            continue
        name = canonicalize_name(project.get("name", ""))
        if name != folder.name:
            problems.append(f"packages/{folder.name}: holds project {project.get('name')!r}; a package's folder "
                            "is named as its project")
            continue
        if name.replace("-", "_") not in table:
            problems.append(f"packages/{folder.name}: not in LAYERS of {LAYERING_TEST} (give it its layer there)")
            continue
        found[name] = project
    for module in sorted(table):
        if module.replace("_", "-") not in found and not any(f"packages/{module.replace('_', '-')}:" in p
                                                            for p in problems):
            problems.append(f"LAYERS of {LAYERING_TEST} names {module}, and packages/{module.replace('_', '-')} "
                            "is not a package folder (renamed or misspelt?)")
    if problems:
        raise PackageError("the repository's packages do not add up:\n  " + "\n  ".join(problems))
    deps = {name: [d for d in requirement_names(project.get("dependencies", []), f"packages/{name}/pyproject.toml")
                   if d in found] for name, project in found.items()}
    depth: dict[str, int] = {}

    def depth_of(name: str, seen: tuple[str, ...] = ()) -> int:
        if name in seen:
            raise PackageError(f"packages/{name}: its dependencies come back to it ({' -> '.join((*seen, name))})")
        if name not in depth:
            depth[name] = 1 + max((depth_of(d, (*seen, name)) for d in deps[name]), default=-1)
        return depth[name]

    # by layer, then within a layer after what a package depends on (ds-autotune needs ds-launch, both layer 0)
    order = sorted(found, key=lambda name: (table[name.replace("-", "_")], depth_of(name), name))
    for name in order:
        layer = table[name.replace("-", "_")]
        for dep in deps[name]:
            if table[dep.replace("-", "_")] > layer:
                raise PackageError(f"packages/{name} (layer {layer}) depends on {dep} (layer "
                                   f"{table[dep.replace('-', '_')]}): a package depends on its layer or lower ones")
    return order


def our_dependencies(root: Path, package: str, known: list[str]) -> list[str]:
    """The packages of ``known`` that ``package`` depends on, recursively, lower layers first."""
    found: list[str] = []

    def visit(name: str) -> None:
        project = _project(root / "packages" / name)
        for dep in requirement_names(project.get("dependencies", []), f"packages/{name}/pyproject.toml"):
            if dep in known and dep not in found:
                visit(dep)
                found.append(dep)

    visit(package)
    return found
