"""Bad input: a one-line error naming the value, exit code 2, never a traceback, nothing started."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("import sys; open(sys.argv[-1], 'w').write('ran')\n")
    return path


def _hostfile(folder, text: str) -> str:
    folder.mkdir(exist_ok=True)
    path = folder / "hostfile"
    path.write_text(text)
    return str(path)


CASES = {
    "missing script": (["missing_script.py"], "user script 'missing_script.py' not found"),
    "missing executable": (["--no_python", "no-such-program-xyz"], "executable 'no-such-program-xyz' not found"),
    "module and no_python": (["--module", "--no_python", "x"], "--module and --no_python cannot be used together"),
    "negative procs": (["--num_procs", "-2", "{script}"], "--num_gpus must be an integer from 1 to 4096, got -2"),
    "zero nodes": (["--num_nodes", "0", "{script}"], "--num_nodes must be an integer from 1 to 4096, got 0"),
    "word count": (["--num_gpus", "two", "{script}"], "--num_gpus must be an integer, got 'two'"),
    "bad port": (["--master_port", "70000", "{script}"], "must be a TCP port number 1-65535, got '70000'"),
    "bad launcher": (["--launcher", "rsh", "{script}"], "invalid choice: 'rsh'"),
    "missing hostfile": (["--hostfile", "{tmp}/nope", "{script}"], "cannot read hostfile {tmp}/nope"),
    "hostfile is a directory": (["--hostfile", "{tmp}", "{script}"], "cannot read hostfile {tmp}"),
    "malformed hostfile": (["--hostfile", "{bad_hostfile}", "{script}"], "line 3: expected 'hostname slots=N', got 'b slots'"),
    "include unknown host": (["--hostfile", "{hostfile}", "--include", "c", "{script}"], "host 'c' is not among the hosts (a, b)"),
    "include unknown slot": (["--hostfile", "{hostfile}", "--include", "a:5", "{script}"], "host 'a' has no slot 5"),
    "exclude unknown host": (["--hostfile", "{hostfile}", "--exclude", "z:0", "{script}"], "host 'z' is not among the hosts"),
    "include and exclude": (["--hostfile", "{hostfile}", "-i", "a", "-e", "b", "{script}"], "cannot be used together"),
    "include and num_nodes": (["--hostfile", "{hostfile}", "-i", "a", "--num_nodes", "1", "{script}"], "cannot be combined"),
    "too many nodes": (["--hostfile", "{hostfile}", "--num_nodes", "3", "{script}"], "--num_nodes 3 asks for more nodes than the 2 available"),
    "node_rank out of range": (["--hostfile", "{hostfile}", "--node_rank", "2", "{script}"], "--node_rank 2 is outside 0..1"),
    "node_rank with launcher": (["--hostfile", "{hostfile}", "--node_rank", "1", "--launcher", "ssh", "{script}"], "cannot be combined with --launcher"),
    "core list without binding": (["--bind_core_list", "0", "{script}"], "--bind_core_list needs --bind_cores_to_rank"),
    "bad core list": (["--bind_cores_to_rank", "--bind_core_list", "0-x", "{script}"], "--bind_core_list '0-x'"),
    "unknown option": (["--num_gpu", "2", "{script}"], "unrecognized option '--num_gpu'; did you mean --num_gpus?"),
    "option typo with a hyphen": (["--save-pid", "{script}"], "unrecognized option '--save-pid'; did you mean --save_pid?"),
    "unknown option with a value": (["--bind_core=0", "{script}"], "unrecognized option '--bind_core'; did you mean --bind_core_list?"),
    "unknown option, nothing close": (["--zzzzzz", "{script}"], "unrecognized option '--zzzzzz' (see ds-launch --help)"),
    "value-taking option without its value": (["--num_procs", "--dry_run", "{script}"], "--num_procs: expected one argument"),
    "bare save_pid before a missing script": (["--save_pid", "{tmp}/nope.pid", "{script}"],
                                               "--save_pid takes no value, use --save_pid=PATH"),
    "save_pid over the script": (["--save_pid={script}", "{script}"], "the file exists and does not hold a pid; refusing to overwrite it"),
    "core list beyond the machine": (["--bind_cores_to_rank", "--bind_core_list", "0-9999", "{script}"],
                                     "--bind_core_list '0-9999' names cores"),
    "no script": ([], "the following arguments are required: user_script"),
    "bad master addr": (["--master_addr", "$(reboot)", "{script}"], "--master_addr: invalid hostname '$(reboot)'"),
    "unwritable log dir": (["--enable_each_rank_log", "/proc/no/such/dir", "{script}"], "--enable_each_rank_log /proc/no/such/dir: cannot create"),
    "unwritable pid file": (["--save_pid=/proc/no/such.pid", "{script}"], "--save_pid=/proc/no/such.pid: cannot write the pid file"),
    "huge procs": (["--num_procs", "3000000000", "{script}"], "--num_gpus must be an integer from 1 to 4096, got 3000000000"),
    "huge slots": (["--hostfile", "{huge}", "{script}"], "line 1: slots must be an integer from 1 to 4096, got '10000000000'"),
    "superscript slot": (["--hostfile", "{hostfile}", "-i", "a:\u00b2", "{script}"], "slot '\u00b2' of host 'a' is not a non-negative integer"),
    "superscript core": (["--bind_cores_to_rank", "--bind_core_list", "\u00b2", "{script}"], "is not a core number"),
    "huge core range": (["--bind_cores_to_rank", "--bind_core_list", "0-3000000000", "{script}"], "core 3000000000 is beyond 65535"),
    "empty core list": (["--bind_cores_to_rank", "--bind_core_list", "", "{script}"], "'' is not a core number"),
    "unbalanced launcher args": (["--hostfile", "{hostfile}", "--launcher_args", "'", "{script}"], "--launcher_args \"'\": No closing quotation"),
    "infinite grace": (["--kill_grace", "inf", "{script}"], "must be a number of seconds from 0 to 3600, got 'inf'"),
    "env file not utf-8": (["--hostfile", "{hostfile}", "{script}"], "not UTF-8 text"),
    "mpich uneven": (["--hostfile", "{uneven}", "--launcher", "mpich", "{script}"], "needs the same number of processes on every node, got a=2, b=1"),
    "openmpi picks slots": (["--hostfile", "{hostfile}", "-i", "a:1@b", "--launcher", "openmpi", "{script}"], "cannot pick slots"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, script, run_launcher):
    args, message = CASES[case]
    values = {
        "script": str(script), "tmp": str(tmp_path),
        "hostfile": _hostfile(tmp_path, "a slots=2\nb slots=2\n"),
        "bad_hostfile": _hostfile(tmp_path / "bad", "a slots=1\n# ok\nb slots\n"),
        "uneven": _hostfile(tmp_path / "uneven", "a slots=2\nb slots=1\n"),
        "huge": _hostfile(tmp_path / "huge", "a slots=10000000000\n"),
    }
    env = {}
    if case == "env file not utf-8":
        (tmp_path / "bad_env").write_bytes(b"A=\xff\xfe\n")
        env["DS_ENV_FILE"] = str(tmp_path / "bad_env")
    marker_file = tmp_path / "ran-marker"
    argv = [a.format(**values) for a in args]
    if "{script}" in args:  # the script writes this file if it ever runs
        argv.append(str(marker_file))
    result = run_launcher(*argv, timeout=30, env=env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("ds-launch: error: ")
    assert message.format(**values) in lines[0]
    assert "Traceback" not in result.stderr
    assert not marker_file.exists(), "the program ran despite the error"
    assert len(lines[0]) < 300, f"{len(lines[0])} characters"
    if "{script}" in args:
        assert script.read_text().startswith("import sys"), "the script was overwritten"


@pytest.mark.parametrize("hostfile, include, exclude, nodes, procs, message", [
    # where DeepSpeed's runner.py raises ValueError (_parse_hostfile, parse_resource_filter,
    # parse_node_config's int(), main's num_nodes/gpus check), ds-launch's helpers do too
    ("a slots=1\na slots=2\n", "", "", None, None, "host 'a' is listed twice"),
    ("a slots\n", "", "", None, None, "expected 'hostname slots=N', got 'a slots'"),
    ("# empty\n", "", "", None, None, "names no host"),
    ("a slots=x\n", "", "", None, None, "slots must be an integer from 1 to 4096, got 'x'"),
    ("a slots=2\n", "a", "a", None, None, "--include and --exclude cannot be used together"),
    ("a slots=2\n", "z", "", None, None, "--include 'z': host 'z' is not among the hosts (a)"),
    ("a slots=2\n", "", "z:0", None, None, "--exclude 'z:0': host 'z' is not among the hosts (a)"),
    ("a slots=2\n", "a:5", "", None, None, "host 'a' has no slot 5"),
    ("a slots=2\n", "a:one", "", None, None, "slot 'one' of host 'a' is not a non-negative integer"),
    ("a slots=2\n", "a", "", 1, None, "--num_nodes/--num_gpus cannot be combined with --include/--exclude"),
    ("a slots=2\n", "", "", 2, None, "--num_nodes 2 asks for more nodes than the 1 available"),
    ("a slots=2\n", "", "", None, 3, "--num_gpus 3 asks for more processes than host 'a' has slots (2)"),
])
def test_public_helpers_raise_value_error_naming_the_value(tmp_path, hostfile, include, exclude, nodes, procs,
                                                            message):
    from ds_launch import parse_hostfile, select_resources

    path = tmp_path / "hostfile"
    path.write_text(hostfile)
    with pytest.raises(ValueError) as info:
        select_resources(parse_hostfile(str(path)), include, exclude, nodes, procs)
    assert message in str(info.value)
    assert type(info.value).__name__ == "LaunchError"  # ValueError, also as the CLI's one-line error


@pytest.mark.parametrize("launcher, program", [("openmpi", "Open MPI's mpirun ('mpirun')"),
                                               ("mvapich", "MVAPICH's mpirun ('mpirun')"),
                                               ("mpich", "MPICH's mpirun ('mpirun')")])
def test_missing_mpi_is_a_clear_error(tmp_path, script, run_launcher, launcher, program):
    """DeepSpeed: RuntimeError "launcher 'X' not installed"; here one line naming what is missing."""
    hostfile = _hostfile(tmp_path, "a slots=1\nb slots=1\n")
    result = run_launcher("--hostfile", hostfile, "--launcher", launcher, str(script), str(tmp_path / "ran"),
                          env={"PATH": str(tmp_path)})
    assert result.returncode == 2
    assert result.stderr.strip() == f"ds-launch: error: --launcher {launcher} needs {program} on PATH; not found"
    assert not (tmp_path / "ran").exists()


def test_core_list_error_is_short_and_names_the_available_cores(tmp_path, script, run_launcher):
    from ds_launch.affinity import available_cores, format_cores

    result = run_launcher("--bind_cores_to_rank", "--bind_core_list", "0-9999", str(script), timeout=30)
    assert result.returncode == 2
    line = result.stderr.strip()
    assert "\n" not in line and len(line) < 200, line  # was 59,000 characters (every missing core listed)
    available = available_cores()
    assert f"(available: {format_cores(available)})" in line or len(format_cores(available)) > 40
    assert f"names cores {max(available) + 1}-9999 " in line or max(available) >= 9999


def test_taken_port_is_a_clear_error(tmp_path, script, run_launcher):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = run_launcher("--master_port", str(port), str(script), str(tmp_path / "ran"), timeout=30)
    assert result.returncode == 2
    assert f"ds-launch: error: --master_port {port} is already in use on 127.0.0.1" in result.stderr
    assert "--master_port" in result.stderr.splitlines()[-1]
    assert not (tmp_path / "ran").exists()


def test_ipv6_master_addr_is_accepted(tmp_path, script, run_launcher, port):
    result = run_launcher("--master_addr", "::1", "--master_port", str(port), "--dry_run", str(script))
    assert result.returncode == 0, result.stderr
    assert "MASTER_ADDR=::1" in result.stdout


def test_help_starts_without_torch():
    code = ("import sys, runpy; sys.argv = ['ds-launch', '--help']\n"
            "try:\n    runpy.run_module('ds_launch', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')]\n"
            "print('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "usage: ds-launch" in out
    assert "HEAVY []" in out


def test_unused_multinode_options_warn_on_a_single_node(tmp_path, script, run_launcher, port):
    result = run_launcher("--launcher", "pdsh", "--master_port", str(port), str(script), str(tmp_path / "ran"))
    assert result.returncode == 0, result.stderr
    assert "warning: --launcher ignored: this is a single-node launch" in result.stderr
    assert (tmp_path / "ran").read_text() == "ran"
