"""ARCHITECTURE.md, the repository's architecture document, stays true to the tree: every repository path
it names exists, every section another file cites (the file name, a comma, the heading in single
quotes) is one of its headings, the top-level README links to it, and no file cites the design document
it replaced. Skipped outside a checkout (ds-all installed from a wheel has no ARCHITECTURE.md next to it)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
DOC = REPO / "ARCHITECTURE.md"
# the retired document's file name, spelt so that this file does not cite it itself
OLD_DOC = "DESIGN" + ".md"
# what is not the repository's own text: VCS data, virtualenvs, caches, build output, run logs
SKIP_DIRS = {".git", ".nox", ".venv", "venv", "__pycache__", ".pytest_cache", ".ruff_cache", "build", "dist",
             "wheelhouse", "runs"}

pytestmark = pytest.mark.skipif(not DOC.is_file(), reason=f"no ARCHITECTURE.md at {REPO} (not a checkout)")


def _repo_files() -> list[Path]:
    """Every file of the checkout, the skipped folders pruned before they are entered."""
    files = []
    for folder, dirnames, filenames in os.walk(REPO):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info"))
        files += [Path(folder) / name for name in sorted(filenames)]
    return [f for f in files if f.is_file()]


def _cited_paths(text: str) -> list[str]:
    """Repository paths in the document: `code` spans with a slash (not a home, variable or absolute
    path, not a placeholder such as packages/<name>/, not generated output such as .nox/) and the
    targets of relative Markdown links."""
    found = []
    for span in re.findall(r"`([^`\n]+)`", text):
        if "/" not in span or any(c.isspace() for c in span) or span.startswith(("~", "$", "/", "http")):
            continue
        if "<" in span or span.split("/")[0] in SKIP_DIRS:
            continue
        found.append(span.split("::")[0])
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if not target.startswith(("http://", "https://", "#", "mailto:")):
            found.append(target.split("#")[0])
    return found


def _headings(text: str) -> set[str]:
    return {line.lstrip("#").strip() for line in text.splitlines() if line.startswith("## ")}


def test_every_path_the_document_names_exists():
    paths = _cited_paths(DOC.read_text(encoding="utf-8"))
    assert len(paths) >= 30, f"only {len(paths)} paths found: the extraction is broken"
    missing = [p for p in paths if not (list(REPO.glob(p)) if "*" in p else (REPO / p).exists())]
    assert missing == [], "ARCHITECTURE.md names paths that do not exist:\n" + "\n".join(missing)


def test_the_extraction_sees_paths_and_skips_what_is_no_path():
    text = ("`packages/ds-zero/src/ds_zero/config.py` `packages/*/benchmarks/bench_*.py` `packages/<name>/` "
            "`~/.cache/ds_ops` `.nox/wheelhouse` `ds_all.comm` `python -m ds_all` [README](README.md) [web](https://example.org)")
    assert _cited_paths(text) == ["packages/ds-zero/src/ds_zero/config.py", "packages/*/benchmarks/bench_*.py",
                                  "README.md"]


def test_every_cited_section_is_a_heading_of_the_document():
    headings = _headings(DOC.read_text(encoding="utf-8"))
    cited = {}
    for path in _repo_files():
        if path.suffix not in (".py", ".md", ".toml", ".txt", ".json", ".cfg", ".sh") and path.parent.name != ".ci":
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for section in re.findall(r"ARCHITECTURE\.md\)?,\s+'([^'\n]+)'", text):
            cited.setdefault(section, []).append(str(path.relative_to(REPO)))
    assert cited, "no file cites a section of ARCHITECTURE.md"
    unknown = {s: where for s, where in cited.items() if s not in headings}
    assert unknown == {}, f"cited sections that are no heading of ARCHITECTURE.md {sorted(headings)}: {unknown}"


def test_the_readme_links_to_the_document():
    assert "](ARCHITECTURE.md)" in (REPO / "README.md").read_text(encoding="utf-8")


def test_no_file_cites_the_retired_design_document():
    needle = OLD_DOC.encode()
    citing = []
    for path in _repo_files():
        for number, line in enumerate(path.read_bytes().splitlines(), 1):
            if needle in line:
                citing.append(f"{path.relative_to(REPO)}:{number}")
    assert citing == [], f"files cite {OLD_DOC} (cite ARCHITECTURE.md and its section instead):\n" + "\n".join(citing)
