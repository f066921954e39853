"""Multi-node for real: a private sshd on loopback, two "nodes" (127.0.0.1 and 127.0.0.2 behind
ssh aliases) with one rank each, launched with --launcher ssh."""

from __future__ import annotations

import getpass
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
pytestmark = pytest.mark.skipif(
    not (os.path.exists(SSHD) and shutil.which("ssh") and shutil.which("ssh-keygen")),
    reason="openssh-server/openssh-client are not installed (the nox sessions install them with apt-get as root)",
)

RANK_PROGRAM = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "CROSS_RANK", "CROSS_SIZE", "FROM_ENV_FILE", "NCCL_FORWARDED"]
    with open(os.path.join(os.environ["DUMP_DIR"], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"sum": t.item(), "argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keys}}, f)
    dist.barrier()  # leave together: tearing gloo down under a peer can abort it
    dist.destroy_process_group()
""")

FAIL_ON_NODE_B = textwrap.dedent("""
    import os, signal, subprocess, sys
    fifo, marker = sys.argv[-2], sys.argv[-1]
    if os.environ["CROSS_RANK"] == "0":
        subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()", marker])
        with open(fifo, "w") as f:
            f.write("go")
        signal.pause()
    with open(fifo) as f:
        f.read()
    sys.exit(5)
""")


BLOCK_AFTER_READY = textwrap.dedent("""
    import os, signal
    os.write(1, f"ready {os.environ['RANK']}\\n".encode())  # one write: see BLOCKING in test_launch.py
    while True:
        signal.pause()
""")


def _wait_for_port(host: str, port: int, process: subprocess.Popen, log) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"sshd exited with {process.returncode}: {log.read_text()}")
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    pytest.fail(f"sshd did not listen on {host}:{port}: {log.read_text()}")


@pytest.fixture
def ssh_config(tmp_path, port):
    """Start sshd on 127.0.0.1 and 127.0.0.2; return an ssh client config with aliases node-a, node-b."""
    keys = tmp_path / "ssh"
    keys.mkdir(mode=0o700)
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name)], check=True)
    (keys / "authorized_keys").write_text((keys / "client_key.pub").read_text())
    (keys / "authorized_keys").chmod(0o600)
    (keys / "sshd_config").write_text(textwrap.dedent(f"""
        Port {port}
        ListenAddress 127.0.0.1
        ListenAddress 127.0.0.2
        HostKey {keys}/host_key
        AuthorizedKeysFile {keys}/authorized_keys
        PidFile {keys}/sshd.pid
        StrictModes no
        UsePAM no
        PasswordAuthentication no
        KbdInteractiveAuthentication no
        PubkeyAuthentication yes
        PermitRootLogin prohibit-password
    """))
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
    log = keys / "sshd.log"
    with open(log, "wb") as out:
        sshd = subprocess.Popen([SSHD, "-D", "-e", "-f", str(keys / "sshd_config")], stdout=out, stderr=out)
    try:
        _wait_for_port("127.0.0.1", port, sshd, log)
        _wait_for_port("127.0.0.2", port, sshd, log)
        config = keys / "client_config"
        config.write_text(textwrap.dedent(f"""
            Host node-a
                HostName 127.0.0.1
            Host node-b
                HostName 127.0.0.2
            Host node-a node-b
                Port {port}
                User {getpass.getuser()}
                IdentityFile {keys}/client_key
                IdentitiesOnly yes
                StrictHostKeyChecking no
                UserKnownHostsFile /dev/null
                LogLevel ERROR
        """))
        probe = subprocess.run(["ssh", "-F", str(config), "-o", "BatchMode=yes", "node-b", "true"],
                               capture_output=True, text=True, timeout=30)
        assert probe.returncode == 0, f"ssh to the test sshd failed: {probe.stderr}\n{log.read_text()}"
        yield config
    finally:
        sshd.terminate()
        sshd.wait(timeout=30)


def _workdir(tmp_path, program: str):
    work = tmp_path / "work"
    work.mkdir()
    (work / "program.py").write_text(program)
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    (work / ".deepspeed_env").write_text(f"DUMP_DIR={dumps}\nFROM_ENV_FILE=yes it is\n")
    (work / "hostfile").write_text("node-a slots=1\nnode-b slots=1\n")
    return work, dumps


def _launcher_options(launcher: str, ssh_config) -> tuple[list[str], dict[str, str]]:
    if launcher == "ssh":
        return ["--launcher", "ssh", "--launcher_args", f"-F {ssh_config}"], {}
    if not shutil.which("pdsh"):
        pytest.skip("pdsh is not installed (the nox sessions install it with apt-get as root)")
    return ["--launcher", "pdsh"], {"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": f"-F {ssh_config}"}


@pytest.mark.parametrize("launcher", ["ssh", "pdsh"])
def test_two_nodes_all_reduce(tmp_path, ssh_config, run_launcher, new_port, launcher):
    work, dumps = _workdir(tmp_path, RANK_PROGRAM)
    options, env = _launcher_options(launcher, ssh_config)
    result = run_launcher("--hostfile", "hostfile", *options, "--master_addr", "127.0.0.1",
                          "--master_port", str(new_port()), "program.py", "--tag", "x y",
                          cwd=work, env={"NCCL_FORWARDED": "through ssh", **env}, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in range(2):
        record = json.loads((dumps / f"rank{rank}.json").read_text())
        assert record["sum"] == 3.0
        assert record["argv"] == ["--local_rank=0", "--tag", "x y"]
        assert record["env"] == {"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "CROSS_RANK": str(rank),
                                 "CROSS_SIZE": "2", "FROM_ENV_FILE": "yes it is", "NCCL_FORWARDED": "through ssh"}


@pytest.mark.parametrize("launcher", ["ssh", "pdsh"])
def test_a_failing_node_stops_the_other_node(tmp_path, ssh_config, run_launcher, marker, alive, new_port, launcher):
    work, _ = _workdir(tmp_path, FAIL_ON_NODE_B)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    options, env = _launcher_options(launcher, ssh_config)
    result = run_launcher("--hostfile", "hostfile", *options, "--master_addr", "127.0.0.1",
                          "--master_port", str(new_port()), "--kill_grace", "2", "program.py",
                          str(fifo), marker, cwd=work, env=env, timeout=120)
    assert result.returncode == 5, result.stderr
    assert "rank 1 (local rank 0 on node 1, node-b) exited with code 5" in result.stderr
    _assert_gone(alive, marker, launcher)


@pytest.mark.parametrize("launcher", ["ssh", "pdsh"])
def test_ctrl_c_stops_every_node(tmp_path, ssh_config, marker, alive, new_port, launcher):
    work, _ = _workdir(tmp_path, BLOCK_AFTER_READY)
    options, env = _launcher_options(launcher, ssh_config)
    process = subprocess.Popen([sys.executable, "-m", "ds_launch", "--hostfile", "hostfile", *options,
                                "--master_addr", "127.0.0.1", "--master_port", str(new_port()), "--kill_grace", "2",
                                "program.py", marker], cwd=work, env={**os.environ, **env},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = {process.stdout.readline().split(":")[-1].strip() for _ in range(2)}
        assert ready == {"ready 0", "ready 1"}
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 130
    finally:
        process.kill()
        process.communicate()
    _assert_gone(alive, marker, launcher)


def _assert_gone(alive, marker: str, launcher: str) -> None:
    """With ssh the launcher returns only after every remote agent has stopped its ranks. pdsh
    exits first and its (detached) ssh clients carry the EOF to the agents, so allow them a moment."""
    deadline = time.monotonic() + (0 if launcher == "ssh" else 20)
    while alive(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive(marker) == [], "a rank or its child survived on a node"
