"""The README's example runs and prints what it says."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs_as_written():
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec", dont_inherit=True), {})
    assert out.getvalue().startswith(
        "zero_optimization.offload_optimizer.devcie: unknown key 'devcie'; did you mean 'device'?")
