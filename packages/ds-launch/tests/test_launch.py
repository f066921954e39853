"""Local launches with real processes: environment, program modes, failure, signals, orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ds_launch.affinity import available_cores, split_cores

ALL_REDUCE = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    with open(os.path.join(os.environ["DUMP_DIR"], f"sum{rank}.json"), "w") as f:
        json.dump({"sum": t.item(), "world": world, "rank": rank}, f)
    dist.barrier()  # leave together: tearing gloo down under a peer can abort it
    dist.destroy_process_group()
""")

# Rank 0 starts a grandchild, then lets rank 1 fail (through a FIFO, so no timing is assumed)
# and blocks; everything must be gone when the launcher returns.
FAILING = textwrap.dedent("""
    import os, signal, subprocess, sys
    fifo, marker, code = sys.argv[-3], sys.argv[-2], int(sys.argv[-1])
    if os.environ["RANK"] == "0":
        if os.environ.get("IGNORE_TERM"):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()", marker])
        with open(fifo, "w") as f:
            f.write("go")
        signal.pause()
    else:
        with open(fifo) as f:
            f.read()
        print("rank 1 failing on purpose", flush=True)
        sys.exit(code)
""")

# Both ranks report ready, then block until a signal; rank 0 may ignore SIGINT/SIGTERM.
BLOCKING = textwrap.dedent("""
    import os, signal, sys
    if os.environ["RANK"] == "0" and os.environ.get("STUBBORN"):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # one write(2) of the whole line: print() under PYTHONUNBUFFERED=1 writes the text and the newline
    # separately, and the two ranks' lines can interleave on the shared pipe ("ready 1ready 0")
    os.write(1, f"ready {os.environ['RANK']}\\n".encode())
    while True:
        signal.pause()
""")


def _write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_two_ranks_all_reduce_over_gloo(tmp_path, dump, run_launcher, port):
    script = _write(tmp_path, "all_reduce.py", ALL_REDUCE)
    _, out, _ = dump
    result = run_launcher("--num_procs", "2", "--master_port", str(port), str(script), env={"DUMP_DIR": str(out)})
    assert result.returncode == 0, result.stderr
    import json

    sums = [json.loads((out / f"sum{r}.json").read_text()) for r in range(2)]
    assert [s["sum"] for s in sums] == [3.0, 3.0]  # 1 + 2 on every rank
    assert [(s["rank"], s["world"]) for s in sums] == [(0, 2), (1, 2)]


def test_every_rank_gets_torchrun_variables_and_local_rank(dump, run_launcher, port):
    script, out, read = dump
    result = run_launcher("--num_procs", "2", "--master_port", str(port), str(script), "--lr", "0.1", "two words",
                          env={"DUMP_DIR": str(out)})
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        record = read(rank)
        assert record["argv"] == [f"--local_rank={rank}", "--lr", "0.1", "two words"]
        env = record["env"]
        assert env["RANK"] == env["LOCAL_RANK"] == env["ROLE_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == str(port)
        assert env["CROSS_RANK"] == env["GROUP_RANK"] == "0"
        assert env["CROSS_SIZE"] == env["GROUP_WORLD_SIZE"] == "1"
        assert env["OMP_NUM_THREADS"] == os.environ.get("OMP_NUM_THREADS")  # untouched without binding


def test_module_no_python_and_no_local_rank(tmp_path, dump, run_launcher, port):
    script, out, read = dump
    env = {"DUMP_DIR": str(out), "PYTHONPATH": str(script.parent)}
    result = run_launcher("--master_port", str(port), "--module", "--no_local_rank", "dump_rank", "x", env=env)
    assert result.returncode == 0, result.stderr
    assert read(0)["argv"] == ["x"]

    wrapper = _write(tmp_path, "wrapper.sh", f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    wrapper.chmod(0o755)
    result = run_launcher("--master_port", str(port), "--no_python", str(wrapper), "y", env=env)
    assert result.returncode == 0, result.stderr
    assert read(0)["argv"] == ["--local_rank=0", "y"]


def test_failing_rank_stops_the_others_and_leaves_no_process(tmp_path, run_launcher, marker, alive, port):
    script = _write(tmp_path, "failing.py", FAILING)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    logs = tmp_path / "logs"
    start = time.monotonic()
    result = run_launcher("--num_procs", "2", "--master_port", str(port), "--enable_each_rank_log", str(logs),
                          str(script), str(fifo), marker, "3", timeout=60)
    elapsed = time.monotonic() - start
    assert result.returncode == 3, result.stderr
    assert f"ds-launch: rank 1 (local rank 1 on node 0, localhost) exited with code 3; its log: {logs}/rank1.log" \
        in result.stderr
    assert "rank 1 failing on purpose" in (logs / "rank1.log").read_text()
    assert elapsed < 15, f"the launcher took {elapsed:.1f} s to give up"
    assert alive(marker) == []


def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace(tmp_path, run_launcher, marker, alive, port):
    script = _write(tmp_path, "failing.py", FAILING)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    result = run_launcher("--num_procs", "2", "--master_port", str(port), "--kill_grace", "0.5", str(script),
                          str(fifo), marker, "7", env={"IGNORE_TERM": "1"}, timeout=60)
    assert result.returncode == 7, result.stderr
    assert "its output is above" in result.stderr
    assert alive(marker) == []


@pytest.mark.parametrize("signum, stubborn", [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGINT, True)])
def test_signal_to_the_launcher_stops_every_rank(tmp_path, marker, alive, port, signum, stubborn):
    script = _write(tmp_path, "blocking.py", BLOCKING)
    env = {**os.environ, **({"STUBBORN": "1"} if stubborn else {})}
    launcher = subprocess.Popen([sys.executable, "-m", "ds_launch", "--num_procs", "2", "--master_port", str(port),
                                 "--kill_grace", "1", str(script), marker],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        ready = {launcher.stdout.readline().strip() for _ in range(2)}
        assert ready == {"ready 0", "ready 1"}
        assert len(set(alive(marker)) - {launcher.pid}) == 2  # the two ranks
        launcher.send_signal(signum)
        assert launcher.wait(timeout=30) == 128 + signum
    finally:
        launcher.kill()
        launcher.communicate()
    assert alive(marker) == []


def test_save_pid_and_rank_logs(tmp_path, dump, run_launcher, port):
    script, out, read = dump
    pid_file = tmp_path / "launcher.pid"
    reader = _write(tmp_path, "pid_reader.py", textwrap.dedent(f"""
        import os, runpy, sys
        print("hello from rank", os.environ["RANK"])
        assert int(open({str(pid_file)!r}).read()) == os.getppid(), "the pid file names the launcher"
        runpy.run_path({str(script)!r}, run_name="__main__")
    """))
    logs = tmp_path / "logs"
    result = run_launcher("--num_procs", "2", "--master_port", str(port), f"--save_pid={pid_file}",
                          "--enable_each_rank_log", str(logs), str(reader), env={"DUMP_DIR": str(out)})
    assert result.returncode == 0, result.stderr
    assert not pid_file.exists(), "the pid file is removed when the launch ends"
    for rank in range(2):
        assert (logs / f"rank{rank}.log").read_text().startswith(f"hello from rank {rank}")
        assert read(rank)["env"]["RANK"] == str(rank)


def test_save_pid_is_a_flag_as_in_deepspeed(tmp_path, dump, run_launcher, port):
    """``--save_pid train.py``: the script is the script (it was taken as the pid file's path); the
    pid goes to DeepSpeed's /tmp/<launcher pid>.deepspeed, removed when the launch ends."""
    script, out, read = dump
    reader = _write(tmp_path, "pid_reader.py", textwrap.dedent(f"""
        import os, runpy
        path = f"/tmp/{{os.getppid()}}.deepspeed"
        assert int(open(path).read()) == os.getppid(), "the pid file names the launcher"
        print("PIDFILE", path)
        runpy.run_path({str(script)!r}, run_name="__main__")
    """))
    result = run_launcher("--save_pid", "--master_port", str(port), str(reader), "--save_pid", "x",
                          env={"DUMP_DIR": str(out)})
    assert result.returncode == 0, result.stderr
    path = result.stdout.split("PIDFILE ", 1)[1].split()[0]
    assert not os.path.exists(path), "the pid file is removed when the launch ends"
    assert read(0)["argv"] == ["--local_rank=0", "--save_pid", "x"]  # the script's own options untouched


@pytest.mark.skipif(len(available_cores()) < 2, reason="needs at least 2 usable cores")
def test_bind_cores_to_rank(dump, run_launcher, port):
    script, out, read = dump
    result = run_launcher("--num_procs", "2", "--master_port", str(port), "--bind_cores_to_rank", str(script),
                          env={"DUMP_DIR": str(out)})
    assert result.returncode == 0, result.stderr
    expected = split_cores(2, None, available_cores())
    for rank in range(2):
        record = read(rank)
        assert tuple(record["cpus"]) == expected[rank]
        assert record["env"]["OMP_NUM_THREADS"] == str(len(expected[rank]))
    assert set(read(0)["cpus"]).isdisjoint(read(1)["cpus"])


def test_node_rank_runs_one_node_each_like_torchrun(tmp_path, dump, port):
    """Two ds-launch invocations, one per "node", form one world of 2 ranks."""
    script = _write(tmp_path, "all_reduce.py", ALL_REDUCE)
    _, out, _ = dump
    hostfile = _write(tmp_path, "hostfile", "localhost slots=1\n127.0.0.1 slots=1\n")
    env = {**os.environ, "DUMP_DIR": str(out)}
    nodes = [subprocess.Popen([sys.executable, "-m", "ds_launch", "--hostfile", str(hostfile), "--node_rank", str(n),
                               "--master_addr", "127.0.0.1", "--master_port", str(port), str(script)],
                              env=env, stderr=subprocess.PIPE, text=True) for n in range(2)]
    for node in nodes:
        _, err = node.communicate(timeout=120)
        assert node.returncode == 0, err
    import json

    assert [json.loads((out / f"sum{r}.json").read_text())["sum"] for r in range(2)] == [3.0, 3.0]


def test_dry_run_prints_the_plan_and_starts_nothing(tmp_path, dump, run_launcher, port):
    script, out, _ = dump
    result = run_launcher("--num_procs", "2", "--master_port", str(port), "--dry_run", str(script), "--flag",
                          env={"DUMP_DIR": str(out)})
    assert result.returncode == 0, result.stderr
    assert list(out.iterdir()) == []
    assert "ds-launch dry run: 1 node(s), 2 rank(s)" in result.stdout
    assert f"{sys.executable} -u {script} --local_rank=1 --flag" in result.stdout
    assert "RANK=1" in result.stdout and f"MASTER_PORT={port}" in result.stdout


def test_ranks_die_with_a_sigkilled_launcher(tmp_path, marker, alive, port):
    """PR_SET_PDEATHSIG: even a launcher killed with SIGKILL leaves no rank behind."""
    script = _write(tmp_path, "blocking.py", BLOCKING)
    launcher = subprocess.Popen([sys.executable, "-m", "ds_launch", "--num_procs", "2", "--master_port", str(port),
                                 str(script), marker], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "STUBBORN": "1"})  # rank 0 ignores SIGTERM and SIGINT
    try:
        assert {launcher.stdout.readline().strip() for _ in range(2)} == {"ready 0", "ready 1"}
        launcher.kill()
        launcher.wait(timeout=30)
    finally:
        launcher.kill()
        launcher.communicate()
    deadline = time.monotonic() + 10  # the kernel delivers the signal at once; exiting takes a moment
    while alive(marker) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert alive(marker) == []


FAKE_MPIRUN = textwrap.dedent("""
    #!{python}
    # A stand-in for Open MPI's mpirun: records its hostfile, then starts -n copies of the command
    # with the OMPI_COMM_WORLD_* variables set, host by host, as `--map-by slot` does.
    import json, os, subprocess, sys
    args = sys.argv[1:]
    n = int(args[args.index("-n") + 1])
    hostfile = args[args.index("-hostfile") + 1]
    slots = [int(line.split("slots=")[1]) for line in open(hostfile)]
    json.dump({{"hostfile": hostfile, "content": open(hostfile).read(), "argv": args}},
              open(os.environ["FAKE_MPIRUN_RECORD"], "w"))
    start = args.index("ds_launch.rank_env") - 3  # python -u -m ds_launch.rank_env
    exported = dict(args[i + 1].split("=", 1) for i in range(start) if args[i] == "-x")
    command = args[start:]
    procs, rank = [], 0
    for size in slots:
        for local in range(size):
            env = dict(os.environ, **exported, OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE=str(n),
                       OMPI_COMM_WORLD_LOCAL_RANK=str(local), OMPI_COMM_WORLD_LOCAL_SIZE=str(size))
            procs.append(subprocess.Popen(command, env=env))
            rank += 1
    sys.exit(max(p.wait() for p in procs))
""")


def test_openmpi_launch_through_a_stand_in_mpirun(tmp_path, dump, run_launcher, port):
    script, out, read = dump
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    mpirun = _write(bin_dir, "mpirun", FAKE_MPIRUN.format(python=sys.executable).lstrip())
    mpirun.chmod(0o755)
    hostfile = _write(tmp_path, "hostfile", "a slots=2\nb slots=1\n")
    (tmp_path / ".deepspeed_env").write_text(f"DUMP_DIR={out}\n")
    record = tmp_path / "mpirun.json"
    result = run_launcher("--hostfile", str(hostfile), "--launcher", "openmpi", "--master_addr", "127.0.0.1",
                          "--master_port", str(port), str(script), "x", cwd=tmp_path,
                          env={"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_MPIRUN_RECORD": str(record)})
    assert result.returncode == 0, result.stderr
    import json

    seen = json.loads(record.read_text())
    assert seen["content"] == "a slots=2\nb slots=1\n"
    assert not os.path.exists(seen["hostfile"]), "the temporary hostfile is removed after the launch"
    layout = [(read(r)["env"]["RANK"], read(r)["env"]["LOCAL_RANK"], read(r)["env"]["CROSS_RANK"]) for r in range(3)]
    assert layout == [("0", "0", "0"), ("1", "1", "0"), ("2", "0", "1")]
    assert [read(r)["env"]["LOCAL_WORLD_SIZE"] for r in range(3)] == ["2", "2", "1"]
    assert all(read(r)["argv"] == [f"--local_rank={read(r)['env']['LOCAL_RANK']}", "x"] for r in range(3))
    # DeepSpeed's OpenMPIRunner defaults: --mca btl ^openib, btl_tcp_if_include eth0, -x UCX_TLS=tcp
    assert seen["argv"][4:12] == ["--mca", "btl", "^openib", "--mca", "btl_tcp_if_include", "eth0", "--map-by", "slot"]
    assert [read(r)["env"]["UCX_TLS"] for r in range(3)] == ["tcp"] * 3


# A stand-in for MVAPICH's mpirun (Hydra): records what it was given, then starts -np copies of
# the command, -ppn per host of its hostfile, with -env NAME=VALUE and Hydra's PMI_* variables.
FAKE_HYDRA = textwrap.dedent("""
    #!{python}
    import json, os, subprocess, sys
    args = sys.argv[1:]
    n, ppn = int(args[args.index("-np") + 1]), int(args[args.index("-ppn") + 1])
    hostfile = args[args.index("--hostfile") + 1]
    hosts = open(hostfile).read().split()
    json.dump({{"content": open(hostfile).read(), "argv": args}}, open(os.environ["FAKE_MPIRUN_RECORD"], "w"))
    start = args.index("ds_launch.rank_env") - 3
    exported = dict(args[i + 1].split("=", 1) for i in range(start) if args[i] == "-env")
    procs = []
    for rank in range(n):
        env = dict(os.environ, **exported, PMI_RANK=str(rank), PMI_SIZE=str(n), MPI_LOCALRANKID=str(rank % ppn))
        procs.append(subprocess.Popen(args[start:], env=env))
    sys.exit(max(p.wait() for p in procs))
""")


def test_mvapich_launch_through_a_stand_in_mpirun(tmp_path, dump, run_launcher, port):
    """DeepSpeed's MVAPICHRunner command: mpirun -np N -ppn P --hostfile <hosts> -env MV2_...=..."""
    script, out, read = dump
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _write(bin_dir, "mpirun", FAKE_HYDRA.format(python=sys.executable).lstrip()).chmod(0o755)
    _write(bin_dir, "mpiname", "#!/bin/sh\necho 'MVAPICH2-GDR 2.3.7 Wed March 02 22:00:00 EST 2022 ch3:mrail'\n").chmod(0o755)
    hostfile = _write(tmp_path, "hostfile", "a slots=2\nb slots=2\n")
    (tmp_path / ".deepspeed_env").write_text(f"DUMP_DIR={out}\nMV2_SUPPORT_DL=0\n")
    record = tmp_path / "mpirun.json"
    result = run_launcher("--hostfile", str(hostfile), "--launcher", "mvapich", "--master_addr", "127.0.0.1",
                          "--master_port", str(port), str(script), cwd=tmp_path,
                          env={"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_MPIRUN_RECORD": str(record)})
    assert result.returncode == 0, result.stderr
    import json

    seen = json.loads(record.read_text())
    assert seen["content"] == "a\nb\n"
    assert seen["argv"][:6] == ["-np", "4", "-ppn", "2", "--hostfile", seen["argv"][5]]
    env_args = seen["argv"][6:seen["argv"].index(sys.executable)]
    # DeepSpeed's defaults in its order, less MV2_USE_CUDA (no GPU here) and the one the user set
    assert env_args == ["-env", "MV2_SMP_USE_CMA=0", "-env", "MV2_DEBUG_SHOW_BACKTRACE=1", "-env", "MV2_ENABLE_AFFINITY=0",
                        "-env", "MV2_INTER_ALLGATHER_TUNING=5", "-env", "MV2_CUDA_USE_NAIVE=0"]
    layout = [(read(r)["env"]["RANK"], read(r)["env"]["LOCAL_RANK"], read(r)["env"]["CROSS_RANK"]) for r in range(4)]
    assert layout == [("0", "0", "0"), ("1", "1", "0"), ("2", "0", "1"), ("3", "1", "1")]
    assert [(read(r)["env"]["MV2_SMP_USE_CMA"], read(r)["env"]["MV2_SUPPORT_DL"]) for r in range(4)] == [("0", "0")] * 4
