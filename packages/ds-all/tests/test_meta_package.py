"""ds-all depends on every ds package, by name and a compatible range, and reports their versions."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import ds_all

REPO = Path(__file__).resolve().parents[3]


def _project(package: str) -> dict:
    return tomllib.loads((REPO / "packages" / package / "pyproject.toml").read_text())["project"]


def test_ds_all_depends_on_every_package_with_a_range_that_admits_its_version():
    packages = sorted(p.parent.name for p in REPO.glob("packages/*/pyproject.toml") if p.parent.name != "ds-all")
    requirements = {re.match(r"[a-z0-9\-]+", r).group(0): r for r in _project("ds-all")["dependencies"]}
    assert sorted(n for n in requirements if n.startswith("ds-")) == packages
    for package in packages:
        version = tuple(int(x) for x in _project(package)["version"].split("."))
        m = re.fullmatch(rf"{package}>=(\d+)\.(\d+),<(\d+)\.(\d+)", requirements[package])
        assert m, f"{requirements[package]!r} is not of the form '{package}>=X.Y,<X.Z'"
        low, high = (int(m[1]), int(m[2])), (int(m[3]), int(m[4]))
        assert low <= version[:2] < high, f"{package} {version} is outside {requirements[package]}"


def test_versions_reports_every_installed_part():
    reported = ds_all.versions()
    assert reported["ds-all"] == ds_all.__ds_version__ == _project("ds-all")["version"]
    for part in ds_all.PARTS:
        assert reported[part] == _project(part)["version"], part


def test_python_m_ds_all_prints_the_table():
    out = subprocess.run([sys.executable, "-m", "ds_all"], capture_output=True, text=True, check=True).stdout
    for name, version in ds_all.versions().items():
        assert re.search(rf"^{name}\s+{re.escape(version)}$", out, re.M), out


def test_python_m_ds_all_help_says_what_it_does_and_bad_flags_fail():
    out = subprocess.run([sys.executable, "-m", "ds_all", "--help"], capture_output=True, text=True, check=True).stdout
    assert out.startswith("usage: python -m ds_all") and "ds-all " not in out.split("\n", 1)[0]
    assert not re.search(r"^ds-all\s+\d", out, re.M)  # no version table in place of help
    bad = subprocess.run([sys.executable, "-m", "ds_all", "--bogus"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unrecognized arguments: --bogus" in bad.stderr and bad.stdout == ""


def test_readme_example_shows_what_versions_returns():
    readme = (REPO / "packages" / "ds-all" / "README.md").read_text()
    shown = re.search(r"print\(ds_all\.versions\(\)\)\s+# \{(.*)\}", readme).group(1)
    pairs = re.findall(r"'([\w-]+)': '([^']+)'", shown)
    assert pairs and all(ds_all.versions()[name] == version for name, version in pairs), pairs
    assert [name for name, _ in pairs] == list(ds_all.versions())[:len(pairs)]  # in the order it returns
    for part in ds_all.PARTS:  # every part is named in the README's first paragraph
        assert f"`{part}`" in readme.split("\n\n")[1], part
