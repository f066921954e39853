"""The README's example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs():
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    exec(compile(code, str(README), "exec", dont_inherit=True), {})


def test_readme_config_table_names_every_key():
    from ds_zero import ZeroConfig

    text = README.read_text()
    for name, field in ZeroConfig.model_fields.items():
        assert f"`{field.alias or name}`" in text, name
