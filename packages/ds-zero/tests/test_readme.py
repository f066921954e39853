"""The README's examples run as written: the training loops (stages 2 and 3) on 2 ranks, the config
example here."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

from ds_comm.testing import spawn

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def run_example(rank, world_size, index):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(_blocks()[index], str(README), "exec", dont_inherit=True), {})
    return out.getvalue()


def test_readme_loop_example_trains_on_two_ranks():
    for printed in spawn(run_example, world_size=2, args=(0,), timeout=120):
        norm, memory = printed.split(" ", 1)
        assert float(norm) > 0 and "'params':" in memory and "'optimizer':" in memory


def test_readme_stage_3_example_trains_on_two_ranks():
    for printed in spawn(run_example, world_size=2, args=(1,), timeout=120):
        assert "'params':" in printed and "'grads':" in printed


def test_readme_config_example_runs():
    exec(compile(_blocks()[2], str(README), "exec", dont_inherit=True), {})


def test_readme_one_bit_example_runs_on_two_ranks():
    for printed in spawn(run_example, world_size=2, args=(3,), timeout=120):
        assert printed.split() == ["5", "3", "ZeroOneAdam"]


def test_readme_config_table_names_every_key():
    from ds_zero import ZeroConfig

    text = README.read_text()
    for name, field in ZeroConfig.model_fields.items():
        assert f"`{field.alias or name}`" in text, name
