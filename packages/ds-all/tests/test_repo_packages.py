"""The test command's inputs (issue 46): the packages it tests come from their pyproject.toml files in the layer
order of test_layering.py, every install goes through constraints.txt and everything installed is pinned there,
and the run's summary line counts what ran and what skipped."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shutil
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "scripts"))
import ci_summary  # noqa: E402
import repo_packages  # noqa: E402

_spec = importlib.util.spec_from_file_location("_layering", Path(__file__).with_name("test_layering.py"))
_layering = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_layering)
LAYERS = _layering.LAYERS  # the layering test's own table, as it runs

NOXFILE = REPO / "noxfile.py"


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"constraints.txt: {line!r} is not name==version"
            assert canonicalize_name(name) not in pins, f"constraints.txt pins {name} twice"
            pins[canonicalize_name(name)] = version
    return pins


def test_the_packages_are_the_folders_in_the_order_of_the_layer_table():
    order = repo_packages.packages(REPO)
    folders = sorted(p.parent.name for p in REPO.glob("packages/*/pyproject.toml"))
    assert sorted(order) == folders
    assert {name.replace("-", "_") for name in order} == set(LAYERS)
    layer = [LAYERS[name.replace("-", "_")] for name in order]
    assert layer == sorted(layer), order
    for i, name in enumerate(order):  # what a package depends on of ours comes before it (one pip command)
        project = tomllib.loads((REPO / "packages" / name / "pyproject.toml").read_text())["project"]
        for dep in repo_packages.requirement_names(project.get("dependencies", []), name):
            if dep in order:
                assert order.index(dep) < i, (name, dep)


def _copy_repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    for pyproject in REPO.glob("packages/*/pyproject.toml"):
        target = root / pyproject.relative_to(REPO)
        target.parent.mkdir(parents=True)
        shutil.copy(pyproject, target)
    target = root / repo_packages.LAYERING_TEST
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / repo_packages.LAYERING_TEST, target)
    return root


def test_a_misspelt_package_folder_fails_naming_it(tmp_path):
    root = _copy_repo(tmp_path)
    assert repo_packages.packages(root) == repo_packages.packages(REPO)
    (root / "packages" / "ds-moe").rename(root / "packages" / "ds-mow")
    with pytest.raises(repo_packages.PackageError) as e:
        repo_packages.packages(root)
    assert "packages/ds-mow: holds project 'ds-moe'" in str(e.value)
    assert "names ds_moe, and packages/ds-moe is not a package folder" in str(e.value)


def test_a_folder_without_pyproject_or_outside_the_layer_table_fails_naming_it(tmp_path):
    root = _copy_repo(tmp_path)
    (root / "packages" / "ds-zer0").mkdir()
    with pytest.raises(repo_packages.PackageError, match=r"packages/ds-zer0: a folder under packages/ without a "
                                                         "pyproject.toml"):
        repo_packages.packages(root)
    shutil.rmtree(root / "packages" / "ds-zer0")
    new = root / "packages" / "ds-new"
    new.mkdir()
    (new / "pyproject.toml").write_text('[project]\nname = "ds-new"\ndependencies = ["ds-config ~= 0.1 ; python_version >= \'3.10\'"]\n')
    with pytest.raises(repo_packages.PackageError, match=r"packages/ds-new: not in LAYERS of "):
        repo_packages.packages(root)


def test_requirements_are_parsed_as_pep_508():
    # the noxfile's old parser split on <, >, = and [: a marker or ~= gave a wrong name
    assert repo_packages.requirement_names(
        ["ds-config ~= 0.1", "ds_comm[ops]>=0.1; python_version >= '3.10'", "Torch==2.13.0"], "x") == \
        ["ds-config", "ds-comm", "torch"]
    with pytest.raises(repo_packages.PackageError, match=r"x: requirement 'ds config' is not PEP 508"):
        repo_packages.requirement_names(["ds config"], "x")


def _function_of(tree: ast.Module, node: ast.AST) -> str | None:
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and any(child is node for child in ast.walk(fn)):
            inner = [f for f in ast.walk(fn) if isinstance(f, ast.FunctionDef) and f is not fn
                     and any(child is node for child in ast.walk(f))]
            return inner[-1].name if inner else fn.name
    return None


def test_every_install_goes_through_the_constraints_file():
    tree = ast.parse(NOXFILE.read_text())
    installs = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute) and node.func.attr == "install"]
    assert installs, "the noxfile installs nothing?"
    for node in installs:  # session.install only in _install, which passes -c <constraints>
        assert _function_of(tree, node) == "_install", f"noxfile.py:{node.lineno}: session.install outside _install"
        assert any(isinstance(a, ast.Constant) and a.value == "-c" for a in node.args), node.lineno
    for node in ast.walk(tree):  # pip run by hand (the shared torch install) passes -c too
        if isinstance(node, ast.Call) and any(isinstance(a, ast.Constant) and a.value == "pip" for a in node.args):
            values = [a.value for a in node.args if isinstance(a, ast.Constant)]
            if "install" in values:
                assert "-c" in values, f"noxfile.py:{node.lineno}: pip install without -c"
    commands = [line for path in (REPO / ".ci" / "run", REPO / "README.md")
                for line in path.read_text().splitlines() if re.search(r"python3? -m pip install .*nox", line)]
    assert len(commands) >= 3, commands  # .ci/run, and the README's two commands
    for line in commands:
        assert "-c constraints.txt" in line, line


def test_everything_the_test_command_installs_is_pinned():
    pins = _pins()
    tree = ast.parse(NOXFILE.read_text())
    wanted = {"nox", "ruff", "build", "torch"}
    for node in ast.walk(tree):  # TEST_DEPS and DEEPSPEED_TEST_DEPS' names
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") in ("TEST_DEPS",):
            wanted |= {canonicalize_name(Requirement(e.value).name) for e in node.value.elts
                       if isinstance(e, ast.Constant)}
    ours = set(repo_packages.packages(REPO))
    for pyproject in REPO.glob("packages/*/pyproject.toml"):
        project = tomllib.loads(pyproject.read_text())["project"]
        requirements = project.get("dependencies", []) + [r for extra in project.get("optional-dependencies", {})
                                                          .values() for r in extra]
        wanted |= {name for name in repo_packages.requirement_names(requirements, str(pyproject)) if name not in ours}
    assert sorted(wanted - set(pins)) == []
    assert pins["torch"] == "2.13.0"


def _junit(path: Path, cases: list[str]) -> None:
    path.write_text("<testsuites><testsuite>" + "".join(cases) + "</testsuite></testsuites>")


def test_the_summary_line_counts_sessions_tests_and_skip_reasons(tmp_path):
    for name, end, ok in (("standalone-ds-io", 1090.0, True), ("tests-rest", 1600.0, False)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"session": name, "run_start": 1000.0, "end": end, "ok": ok}))
    passed = '<testcase name="a"/>'
    skip = '<testcase name="s"><skipped message="tests/x.py:12: libaio missing"/></testcase>'
    _junit(tmp_path / "standalone-ds-io.ds-io.0.xml", [passed, passed, skip])
    _junit(tmp_path / "tests-rest.ds-all.0.xml", [passed, '<testcase name="f"><failure message="boom"/></testcase>',
                                                  skip, '<testcase name="t"><skipped message="no AMX"/></testcase>'])
    lines = ci_summary.summarize(tmp_path, "CPU: Xeon; features: avx512f")
    assert lines[0] == ("ci summary: 2 sessions in 10m00s (1 failed); tests 3 passed, 1 failed, 3 skipped "
                        "(2 reasons); CPU: Xeon; features: avx512f | standalone-ds-io 1m30s 2p/1s; "
                        "tests-rest 8m30s 1p/2s/1F FAILED")
    assert lines[1:] == ["  skipped   2x: libaio missing", "  skipped   1x: no AMX"]
    late = ci_summary.summarize(tmp_path, "CPU: Xeon", budget_s=500)
    assert late[-1] == ("ci summary: WARNING: 1m40s over the 8m20s budget: find what grew (pytest's --durations in "
                        "each session's log)")
