"""The README's examples run as written and print what their comments say."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

from ds_comm.testing import spawn

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def _promised(block: str) -> list[str]:
    return re.findall(r"#\s+(.+?)(?:\s+\(and (.+)\))?$", block.strip().splitlines()[-1])[0]


def run_example(rank, world_size, index):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(_blocks()[index], str(README), "exec", dont_inherit=True), {})
    return out.getvalue()


def test_readme_training_example_runs_on_two_ranks_and_prints_what_it_says():
    first, last = _promised(_blocks()[0])
    assert spawn(run_example, world_size=2, args=(0,), timeout=120) == [first + "\n", last + "\n"]


def test_readme_schedule_and_config_examples_run():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(_blocks()[1], str(README), "exec", dont_inherit=True), {})
    table, streams = out.getvalue().rstrip("\n").rsplit("\n", 1)
    assert "F0" in table and "B3" in table and streams.startswith("[")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(_blocks()[2], str(README), "exec", dont_inherit=True), {})
    assert out.getvalue() == _promised(_blocks()[2])[0] + "\n"
