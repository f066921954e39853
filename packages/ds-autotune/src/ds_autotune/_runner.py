"""Running one experiment: its files under ``exps_dir``/``results_dir``, and a short real run of the
user's script through ``ds-launch`` (a subprocess), whose engine writes the metric file and exits after
``end_profile_step``. Every file this package writes is written atomically (temp file + rename)."""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ._keys import get_val_by_key

log = logging.getLogger("ds_autotune")

CONFIG_OPTIONS = ("--deepspeed_config", "--ds_config", "--deepspeed")


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory renamed over it: a
    reader sees the old file or the whole new one, never a torn one."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json(path: str, value: Any) -> None:
    write_atomic(path, json.dumps(value, indent=2, sort_keys=False) + "\n")


def config_index(user_args: Sequence[str]) -> int:
    """The index of the config path in the script's arguments (after --deepspeed_config)."""
    args = list(user_args)
    for option in CONFIG_OPTIONS:
        if option in args:
            i = args.index(option)
            if i + 1 < len(args) and (option != "--deepspeed" or args[i + 1].endswith(".json")):
                return i + 1
    for i, word in enumerate(args):
        if word.split("=", 1)[0] in CONFIG_OPTIONS[:2] and "=" in word:
            return i
    raise ValueError("ds-autotune: the script's arguments must name the DeepSpeed config "
                     f"(--deepspeed_config cfg.json), got {shlex.join(args)!r}")


def with_config(user_args: Sequence[str], path: str, exp: Mapping | None = None,
                arg_mappings: Mapping | None = None) -> list[str]:
    """The script's arguments with the config replaced by ``path`` and, with ``arg_mappings``
    (DeepSpeed's: config key -> the script's option), each mapped option set to the experiment's value
    (the key found at any depth of its config, as `get_val_by_key` finds it: ``stage`` too)."""
    args = list(user_args)
    i = config_index(args)
    args[i] = f"{args[i].split('=', 1)[0]}={path}" if "=" in args[i] and args[i].startswith("--") else path
    for key, option in (arg_mappings or {}).items():
        value = get_val_by_key((exp or {}).get("ds_config", {}), key)
        if value is None or value == "auto":
            continue
        if option in args and args.index(option) + 1 < len(args):
            args[args.index(option) + 1] = str(value)
        else:
            args += [option, str(value)]
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_command() -> list[str]:
    """``ds-launch`` from PATH, else the running Python's ``-m ds_launch``."""
    found = shutil.which("ds-launch")
    return [found] if found else [sys.executable, "-m", "ds_launch"]


class Runner:
    """Runs experiments one at a time (``exps_dir/<name>.json`` describes each; ``results_dir/<name>/``
    holds its ds_config.json, cmd.txt, stdout.log, stderr.log and the metric file the engine wrote)."""

    def __init__(self, user_script: str, user_args: Sequence[str], *, results_dir: str, exps_dir: str,
                 launcher_args: Sequence[str] = (), overwrite: bool = False, timeout: float = 600.0,
                 arg_mappings: Mapping | None = None) -> None:
        config_index(user_args)  # fail now, not at the first experiment
        self.user_script, self.user_args = user_script, list(user_args)
        self.results_dir, self.exps_dir = results_dir, exps_dir
        self.launcher_args = list(launcher_args)
        self.overwrite, self.timeout, self.arg_mappings = overwrite, timeout, arg_mappings
        self.count = 0

    def command(self, exp: Mapping, config_path: str, port: int | None = None) -> list[str]:
        cmd = launcher_command() + list(self.launcher_args)
        if port is not None:
            cmd += ["--master_port", str(port)]
        return [*cmd, self.user_script, *with_config(self.user_args, config_path, exp, self.arg_mappings)]

    def run(self, exp: dict, output_key: str = "metric_path", output_name: str = "metrics.json") -> dict | None:
        """Run ``exp`` (its ``ds_config["autotuning"]`` gets ``output_key`` = the result file); the JSON
        the engine wrote, or None when the run failed (the reason is logged; stderr.log keeps it)."""
        result_dir = os.path.join(self.results_dir, exp["name"])
        output = os.path.abspath(os.path.join(result_dir, output_name))
        exp["result_dir"] = result_dir
        exp["ds_config"].setdefault("autotuning", {})[output_key] = output
        config_path = os.path.abspath(os.path.join(result_dir, "ds_config.json"))
        stored = os.path.join(result_dir, "exp.json")
        if not self.overwrite and os.path.isfile(output) and os.path.isfile(stored):
            with open(stored) as f:
                previous = json.load(f)
            if previous.get("ds_config") == exp["ds_config"] and previous.get("user_args") == self.user_args:
                log.info("%s: reusing the result in %s (autotuning.overwrite is false)", exp["name"], output)
                return _read_json(output)
        self.count += 1
        write_json(os.path.join(self.exps_dir, f"{exp['name']}.json"), _description(exp))
        os.makedirs(result_dir, exist_ok=True)
        if os.path.exists(output):
            os.unlink(output)
        write_json(config_path, exp["ds_config"])
        cmd = self.command(exp, config_path, free_port())
        write_atomic(os.path.join(result_dir, "cmd.txt"), shlex.join(cmd) + "\n")
        start = time.perf_counter()
        with open(os.path.join(result_dir, "stdout.log"), "wb") as out, \
                open(os.path.join(result_dir, "stderr.log"), "wb") as err:
            try:
                rc = subprocess.run(cmd, stdout=out, stderr=err, timeout=self.timeout).returncode
            except subprocess.TimeoutExpired:
                rc = None
        exp["wall_s"] = time.perf_counter() - start
        if rc != 0 or not os.path.isfile(output):
            why = f"timed out after {self.timeout:g} s" if rc is None else f"exit code {rc}" if rc else \
                f"no {output_name} written"
            exp["error"] = f"{why}; see {os.path.join(result_dir, 'stderr.log')}"
            log.warning("%s failed (%s)%s", exp["name"], exp["error"], _last_line(result_dir))
            write_json(stored, {**_description(exp), "user_args": self.user_args})
            return None
        write_json(stored, {**_description(exp), "user_args": self.user_args})
        return _read_json(output)


def _description(exp: Mapping) -> dict:
    return {k: v for k, v in exp.items() if k != "features"}


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        log.warning("cannot read %s: %s", path, e)
        return None


def _last_line(result_dir: str) -> str:
    try:
        with open(os.path.join(result_dir, "stderr.log"), errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return ""
    return f": {lines[-1][:300]}" if lines else ""
