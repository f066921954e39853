"""The layers of ARCHITECTURE.md, 'The layers', checked from the code's own imports.

A package may import one of ours only if it is of a lower layer AND declared in its
pyproject.toml; ds-launch may import nothing outside the standard library. ds-config is the
bottom brick (layer 0 in ARCHITECTURE.md, below the other layer-0 packages here): every package with a
config section may use it, and it imports nothing of ours. The checker is proven on a
deliberately bad fixture before it is trusted with the real tree.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
BAD_REPO = Path(__file__).resolve().parent / "fixtures" / "bad_repo"

LAYERS = {
    "ds_config": -1,  # L0 in ARCHITECTURE.md, usable by every package with a config section
    "ds_ops": 0, "ds_profiler": 0, "ds_launch": 0, "ds_autotune": 0,
    "ds_comm": 1, "ds_io": 1, "ds_compress": 1,
    "ds_zero": 2, "ds_pipe": 2, "ds_data": 2, "ds_moe": 2, "ds_parallel": 2,
    "ds_all": 3,
}
STDLIB_ONLY = {"ds_launch", "ds_autotune"}


def imports_of(path: Path) -> list[tuple[str, int]]:
    """Absolute module names imported by a file: import/from statements anywhere, and
    importlib.import_module / __import__ calls with a literal name."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, node.lineno))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.args[0].value, node.lineno))
    return found


def _requirement_name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0).lower().replace("-", "_")


def check_repo(root: Path) -> list[str]:
    violations = []
    for pyproject in sorted(root.glob("packages/*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
        package_dir = pyproject.parent
        module = project["name"].replace("-", "_")
        if module not in LAYERS:
            violations.append(f"{project['name']}: not in the layer table of ARCHITECTURE.md, 'The layers'")
            continue
        declared = {_requirement_name(r) for r in project.get("dependencies", [])}
        # an optional extra declares its packages too (ds-comm[ops]: ds_comm imports ds_ops lazily, guarded)
        declared |= {_requirement_name(r) for extra in project.get("optional-dependencies", {}).values()
                     for r in extra}
        for folder in ("src", "tests", "benchmarks"):
            for path in sorted((package_dir / folder).rglob("*.py")):
                if "fixtures" in path.relative_to(package_dir).parts:
                    continue
                where = path.relative_to(root)
                for name, line in imports_of(path):
                    top = name.split(".")[0]
                    if top == module:
                        continue
                    if top in LAYERS and module in STDLIB_ONLY and folder == "src":
                        violations.append(f"{where}:{line}: {module} must use the standard library only, "
                                          f"imports {top}")
                    elif top in LAYERS:
                        if LAYERS[top] >= LAYERS[module]:
                            violations.append(f"{where}:{line}: {module} (layer {LAYERS[module]}) imports "
                                              f"{top} (layer {LAYERS[top]}); imports must point down")
                        elif top not in declared:
                            violations.append(f"{where}:{line}: {module} imports {top}, "
                                              "which its pyproject.toml does not declare")
                    elif module in STDLIB_ONLY and folder == "src" and top not in sys.stdlib_module_names:
                        violations.append(f"{where}:{line}: {module} must use the standard library only, "
                                          f"imports {top}")
    return violations


def test_the_checker_catches_every_bad_import_of_the_fixture():
    found = check_repo(BAD_REPO)
    expected = [
        "ds_io (layer 1) imports ds_zero (layer 2)",
        "ds_io (layer 1) imports ds_comm (layer 1)",
        "ds_io imports ds_profiler, which its pyproject.toml does not declare",
        "ds_io (layer 1) imports ds_all (layer 3)",
        "ds_launch must use the standard library only, imports torch",
        "ds_launch must use the standard library only, imports ds_config",
        "ds_config (layer -1) imports ds_ops (layer 0)",
    ]
    assert len(found) == len(expected), "\n".join(found)
    for fragment in expected:
        assert any(fragment in v for v in found), f"missing {fragment!r} in:\n" + "\n".join(found)
    assert not any("ds_io" in v and "imports ds_ops" in v for v in found)  # the good imports pass
    assert not any("ds_io" in v and "imports ds_config" in v for v in found)


def test_the_real_tree_respects_the_layers():
    assert (REPO / "noxfile.py").exists(), "run from a checkout of the repository"
    violations = check_repo(REPO)
    assert violations == [], "\n".join(violations)


@pytest.mark.parametrize("package", sorted(p.parent.name for p in REPO.glob("packages/*/pyproject.toml")))
def test_every_package_has_the_anatomy_of_architecture_md(package):
    root = REPO / "packages" / package
    module = package.replace("-", "_")
    for part in ("pyproject.toml", "README.md", "CHANGELOG.md", f"src/{module}/__init__.py", "tests"):
        assert (root / part).exists(), f"{package} lacks {part}"
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert project["name"] == package
    assert re.fullmatch(r"\d+\.\d+\.\d+", project["version"])
