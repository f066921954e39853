"""``--deepspeed_alias``: an unmodified DeepSpeed script (``import deepspeed``) runs on ds_all.

The folder ``_deepspeed_alias`` of this package holds a package named ``deepspeed`` (a few lines,
standard library) that turns ``deepspeed`` into the ``ds_all`` module and ``deepspeed.X`` into
``ds_all.X``. With the flag, every rank gets that folder first on its PYTHONPATH, for this launch
only; nothing is installed. ds-launch never imports ds_all: it asks the ranks' Python, in a child
process, whether ``deepspeed`` and ``ds_all`` can be found, and refuses to start when a real
DeepSpeed is importable (the alias would hide it) or ds_all is not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from .resources import LaunchError
from .spec import Program

ALIAS_FLAG = "--deepspeed_alias"

# Run by the ranks' interpreter: where would `deepspeed` and `ds_all` come from? (A folder named
# deepspeed without __init__.py is a namespace portion, which the alias package wins over: not a DeepSpeed.)
_PROBE = """
import importlib.util, json, sys
sys.path[0:1] = sys.argv[1:]
def origin(name):
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return None if spec is None else spec.origin
print(json.dumps([origin("deepspeed"), origin("ds_all")]))
"""


def alias_dir() -> str:
    """The folder to put on PYTHONPATH: this machine's copy of ``_deepspeed_alias``."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_deepspeed_alias")


def check_alias(program: Program, multi_node: bool, python: str = sys.executable, cwd: str | None = None,
                environ: dict[str, str] | None = None) -> None:
    """Refuse, before any rank starts, an alias that would hide a real DeepSpeed or find no ds_all.

    Asks ``python`` (the ranks' interpreter) with the ranks' first ``sys.path`` entry: the
    script's folder, or the working directory for ``-m`` and executables; a multi-node launch
    also puts the working directory on PYTHONPATH, as DeepSpeed's runners do."""
    cwd = os.path.abspath(cwd or os.getcwd())
    first = os.path.dirname(os.path.realpath(os.path.join(cwd, program.target))) if program.mode == "script" else cwd
    paths = [first] + ([cwd] if multi_node else [])
    env = dict(os.environ if environ is None else environ)
    try:
        done = subprocess.run([python, "-c", _PROBE, *paths], capture_output=True, text=True, timeout=120,
                              cwd=cwd, env=env)
    except (OSError, subprocess.SubprocessError) as e:
        raise LaunchError(f"{ALIAS_FLAG}: cannot run {python} to see which packages it finds: {e}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise LaunchError(f"{ALIAS_FLAG}: {python} failed to say which packages it finds: {last}")
    try:
        deepspeed, ds_all = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, TypeError, IndexError):
        raise LaunchError(f"{ALIAS_FLAG}: unexpected answer from {python}: {done.stdout.strip()[-80:]!r}") from None
    if deepspeed is not None:
        raise LaunchError(f"{ALIAS_FLAG}: a real DeepSpeed is importable by {python} ({deepspeed}); the alias would "
                          f"hide it: run without {ALIAS_FLAG} (or uninstall deepspeed)")
    if ds_all is None:
        raise LaunchError(f"{ALIAS_FLAG} maps deepspeed to ds_all, which {python} cannot import: pip install ds-all")
