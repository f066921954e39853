"""``--deepspeed_alias``: an unmodified ``import deepspeed`` script runs on ds_all, for one launch.

Most tests use a stand-in ``ds_all`` (a few files first on PYTHONPATH), so they run where only
ds-launch is installed; one runs the real ds_all when it is importable.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from ds_launch._alias import alias_dir, check_alias
from ds_launch.spec import Program

# What a DeepSpeed script does with the package, checked from inside a rank.
PROBE_SCRIPT = textwrap.dedent("""
    import importlib.metadata, importlib.util, json, os, sys
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.runtime.zero import MARK
    import ds_all, ds_all.comm, ds_all.runtime.zero
    try:
        import deepspeed.no_such_module
        missing = None
    except ModuleNotFoundError as e:
        missing = e.name
    try:
        importlib.metadata.version("deepspeed")
        metadata = "found"
    except importlib.metadata.PackageNotFoundError:
        metadata = "not found"
    record = {
        "name": deepspeed.__name__, "comm": dist.__name__, "mark": MARK,
        "same": [deepspeed is ds_all, dist is ds_all.comm, sys.modules["deepspeed.runtime.zero"] is ds_all.runtime.zero],
        "spec_names": [ds_all.comm.__spec__.name, ds_all.runtime.zero.__spec__.name],
        "loaded": ds_all.comm.LOADED, "missing": missing, "metadata": metadata,
        "find_spec": importlib.util.find_spec("deepspeed") is not None,
    }
    with open(os.path.join(os.environ["OUT"], f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(record, f)
""")


def _package(root, name: str, files: dict[str, str]):
    for relative, text in files.items():
        path = root / name / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.fixture
def stand_in_ds_all(tmp_path):
    """A folder holding a tiny ``ds_all`` (comm counts how often it is executed)."""
    return _package(tmp_path / "fake", "ds_all", {
        "__init__.py": "",
        "comm.py": "import builtins\nLOADED = getattr(builtins, 'COMM_LOADS', 0) + 1\nbuiltins.COMM_LOADS = LOADED\n",
        "runtime/__init__.py": "",
        "runtime/zero.py": "MARK = 'zero-of-the-stand-in'\n",
    })


def _pythonpath(*folders) -> str:
    return os.pathsep.join([*map(str, folders), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)


def test_deepspeed_imports_are_ds_all_in_every_rank(tmp_path, stand_in_ds_all, run_launcher, port):
    script = tmp_path / "train.py"
    script.write_text(PROBE_SCRIPT)
    (tmp_path / "deepspeed").mkdir()  # a plain folder named deepspeed (no __init__.py) next to the script
    out = tmp_path / "out"
    out.mkdir()
    result = run_launcher("--deepspeed_alias", "--num_procs", "2", "--master_port", str(port), str(script),
                          env={"PYTHONPATH": _pythonpath(stand_in_ds_all), "OUT": str(out)})
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        record = json.loads((out / f"rank{rank}.json").read_text())
        assert record["name"] == "ds_all" and record["comm"] == "ds_all.comm"
        assert record["mark"] == "zero-of-the-stand-in"
        assert record["same"] == [True, True, True]  # one module object under both names
        assert record["spec_names"] == ["ds_all.comm", "ds_all.runtime.zero"]  # each keeps its own identity
        assert record["loaded"] == 1  # never executed twice
        assert record["missing"] == "deepspeed.no_such_module"
        assert record["metadata"] == "not found"  # no distribution metadata: pip and version checks see no DeepSpeed
        assert record["find_spec"] is True


def test_without_the_flag_there_is_no_deepspeed(tmp_path, stand_in_ds_all, run_launcher, port):
    script = tmp_path / "train.py"
    script.write_text("import deepspeed\n")
    result = run_launcher("--master_port", str(port), str(script), env={"PYTHONPATH": _pythonpath(stand_in_ds_all)})
    assert result.returncode != 0
    assert "No module named 'deepspeed'" in result.stderr


def test_refused_before_any_rank_when_a_real_deepspeed_is_importable(tmp_path, stand_in_ds_all, run_launcher, port):
    real = _package(tmp_path / "site", "deepspeed", {"__init__.py": "__version__ = '0.19.8'\n"})
    script = tmp_path / "train.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('ran')\n")
    result = run_launcher("--deepspeed_alias", "--master_port", str(port), str(script),
                          env={"PYTHONPATH": _pythonpath(stand_in_ds_all, real)})
    assert result.returncode == 2
    line = result.stderr.strip()
    assert line.startswith("ds-launch: error: --deepspeed_alias: a real DeepSpeed is importable by ")
    assert str(real / "deepspeed" / "__init__.py") in line and "\n" not in line
    assert not (tmp_path / "ran").exists()


def test_the_alias_itself_refuses_to_hide_a_real_deepspeed(tmp_path, stand_in_ds_all):
    """A node where DeepSpeed is installed (ds-launch checked only the launching machine)."""
    real = _package(tmp_path / "site", "deepspeed", {"__init__.py": ""})
    done = subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": _pythonpath(alias_dir(), stand_in_ds_all, real)})
    assert done.returncode == 1
    assert "ImportError: ds-launch --deepspeed_alias: a real DeepSpeed is installed" in done.stderr
    assert str(real / "deepspeed" / "__init__.py") in done.stderr


def test_without_ds_all_the_errors_say_what_to_install(tmp_path):
    """python -S: no site-packages, so no ds_all (nor deepspeed) whatever this machine has installed."""
    wrapper = tmp_path / "python-no-site"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    wrapper.chmod(0o755)
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(ValueError, match=r"--deepspeed_alias maps deepspeed to ds_all, which .*python-no-site "
                                         r"cannot import: pip install ds-all"):
        check_alias(Program(str(script)), False, python=str(wrapper), cwd=str(tmp_path))
    done = subprocess.run([str(wrapper), "-c", "import deepspeed"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": alias_dir()})
    assert "ModuleNotFoundError: ds-launch --deepspeed_alias: `import deepspeed` maps to ds_all, which is not " \
           "installed" in done.stderr


def test_the_ranks_pythonpath_starts_with_the_alias_folder(tmp_path, stand_in_ds_all, run_launcher):
    script = tmp_path / "train.py"
    script.write_text("")
    result = run_launcher("--deepspeed_alias", "--dry_run", str(script), env={"PYTHONPATH": str(stand_in_ds_all)})
    assert result.returncode == 0, result.stderr
    assert f"PYTHONPATH={alias_dir()}:{stand_in_ds_all} " in result.stdout


@pytest.mark.skipif(importlib.util.find_spec("ds_all") is None,
                    reason="ds_all is not importable: the standalone ds-launch CI session installs only ds-launch")
def test_an_unmodified_deepspeed_script_runs_on_the_real_ds_all(tmp_path, run_launcher, port):
    script = tmp_path / "train.py"
    script.write_text("import deepspeed\nimport deepspeed.comm as dist\n"
                      "from deepspeed.accelerator import get_accelerator\n"
                      "print('ALIAS', deepspeed.__name__, dist.__name__, deepspeed.initialize.__module__.split('.')[0])\n")
    result = run_launcher("--deepspeed_alias", "--master_port", str(port), str(script), timeout=300)
    assert result.returncode == 0, result.stderr
    assert "ALIAS ds_all ds_all.comm ds_all" in result.stdout


def test_the_alias_travels_with_the_launch_to_other_nodes(tmp_path):
    """ssh/pdsh node agents and the MPI rank shim rebuild the plan on their node from the spec:
    the alias folder is that node's copy, before the PYTHONPATH the launch forwards."""
    from ds_launch.runners import build_commands
    from ds_launch.spec import NodeSpec

    spec = NodeSpec({"a": [0], "b": [0]}, 0, "a", 29500, Program("train.py"), deepspeed_alias=True)
    (command,) = build_commands("openmpi", spec, environ={"PATH": "/bin", "PYTHONPATH": "/lib/x"}, cwd=str(tmp_path))
    decoded = NodeSpec.decode(command.argv[-1], 1)
    assert decoded.deepspeed_alias
    (plan,) = decoded.plan()
    assert plan.env["PYTHONPATH"] == os.pathsep.join([alias_dir(), str(tmp_path), "/lib/x"])
    (plain,) = NodeSpec.decode(build_commands("openmpi", NodeSpec({"a": [0], "b": [0]}, 0, "a", 29500, Program("t.py")),
                                              environ={}, cwd=str(tmp_path))[0].argv[-1]).plan()
    assert "PYTHONPATH" not in plain.env
