"""An elastic job through ds-launch for real: 4 ranks on 2 "nodes" (ssh to 127.0.0.1 and 127.0.0.2, a private
sshd for each), training with ds_all and elasticity enabled. One node is lost mid-run (its sshd stops, its ranks
are killed): the job goes on on the other node at world size 2 from the latest checkpoint, with the same global
batch (another micro-batch/accumulation split); the node comes back and is admitted at the next restart, at world
size 4. The losses of every step, across all three rounds, match one uninterrupted run in plain torch (same data,
same global batch), so each restart resumed exactly where its checkpoint left off."""

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
from pathlib import Path

import pytest
import torch
from torch import nn

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
pytestmark = pytest.mark.skipif(
    not (os.path.exists(SSHD) and shutil.which("ssh") and shutil.which("ssh-keygen")),
    reason="openssh-server/openssh-client are not installed (ds-launch's nox session installs them as root)",
)

TRAIN = Path(__file__).with_name("_elastic_train.py")
STEPS, LR = 16, 1e-2
CONFIG = {"elasticity": {"enabled": True, "max_train_batch_size": 16, "micro_batch_sizes": [2, 4], "min_gpus": 1,
                         "max_gpus": 4, "version": 0.1},  # global batch 16 on 1, 2 or 4 ranks
          "optimizer": {"type": "Adam", "params": {"lr": LR}}, "gradient_clipping": 1.0,
          "zero_optimization": {"stage": 1}, "steps_per_print": 1000}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Sshd:
    """One sshd per "node" address, so that a node can go down (no new connections) and come back."""

    def __init__(self, keys: Path, address: str, port: int):
        self.config = keys / f"sshd_{address}"
        self.config.write_text(textwrap.dedent(f"""
            Port {port}
            ListenAddress {address}
            HostKey {keys}/host_key
            AuthorizedKeysFile {keys}/authorized_keys
            PidFile none
            StrictModes no
            UsePAM no
            PasswordAuthentication no
            KbdInteractiveAuthentication no
            PubkeyAuthentication yes
            PermitRootLogin prohibit-password
        """))
        self.log, self.address, self.port, self.process = keys / f"sshd_{address}.log", address, port, None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen([SSHD, "-D", "-e", "-f", str(self.config)], stdout=out, stderr=out)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"sshd exited with {self.process.returncode}: {self.log.read_text()}")
            try:
                socket.create_connection((self.address, self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        pytest.fail(f"sshd did not listen on {self.address}:{self.port}")

    def stop(self) -> None:
        """Stop listening; sessions already open (the node's agent) live on, as on a real machine."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)


@pytest.fixture
def nodes(tmp_path):
    keys = tmp_path / "ssh"
    keys.mkdir(mode=0o700)
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name)], check=True)
    (keys / "authorized_keys").write_text((keys / "client_key.pub").read_text())
    (keys / "authorized_keys").chmod(0o600)
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", exist_ok=True)
    port = _free_port()
    daemons = {"node-a": _Sshd(keys, "127.0.0.1", port), "node-b": _Sshd(keys, "127.0.0.2", port)}
    try:
        for daemon in daemons.values():
            daemon.start()
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
        yield config, daemons
    finally:
        for daemon in daemons.values():
            daemon.stop()


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for(what: str, condition, launcher: subprocess.Popen, deadline: float) -> None:
    while not condition():
        if launcher.poll() is not None:
            pytest.fail(f"the launcher exited ({launcher.returncode}) while waiting for {what}:\n"
                        f"{launcher.communicate()[1]}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def _reference_losses(steps: int) -> list[float]:
    """One uninterrupted run in plain torch: the same model, data, global batch of 16 and clipping, one process."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(1, steps + 1):
        g = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    return losses


def _alive(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes() \
                    and "\nState:\tZ" not in (entry / "status").read_text():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


@pytest.mark.timeout(240)
def test_an_elastic_job_survives_a_lost_node_and_admits_it_again(tmp_path, nodes):
    ssh_config, daemons = nodes
    work, out, ckpt = tmp_path / "work", tmp_path / "out", tmp_path / "ckpt"
    for d in (work, out):
        d.mkdir()
    script = work / "train_elastic.py"  # a copy: its path marks every rank's command line
    shutil.copy(TRAIN, script)
    (work / "cfg.json").write_text(json.dumps(CONFIG))
    (work / "hostfile").write_text("node-a slots=2\nnode-b slots=2\n")
    log = out / "elastic.jsonl"
    deadline = time.monotonic() + 200
    launcher = subprocess.Popen(
        [sys.executable, "-m", "ds_launch", "--hostfile", "hostfile", "--elastic_training", "--launcher_args",
         f"-F {ssh_config}", "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), "--max_restarts", "3",
         "--elastic_timeout", "30", "--monitor_interval", "0.5", "--kill_grace", "3", str(script),
         "--deepspeed_config", "cfg.json", "--ckpt", str(ckpt), "--out", str(out), "--steps", str(STEPS),
         "--pace", "0.3"],
        cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    try:
        _wait_for("2 steps at world size 4", lambda: any(r["step"] >= 2 for r in _records(log)), launcher, deadline)
        daemons["node-b"].stop()  # node-b goes away: no new connections, its ranks die
        for pid_file in out.glob("pid_restart0_node1_rank*"):
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
        _wait_for("3 steps at world size 2",
                  lambda: sum(r["world"] == 2 for r in _records(log)) >= 3, launcher, deadline)
        daemons["node-b"].start()  # node-b is back
        _, err = launcher.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGINT)
            launcher.communicate(timeout=60)
    assert launcher.returncode == 0, err
    assert _alive(str(script)) == [], "a rank survived the job"

    records = _records(log)
    rounds = [(r["restart"], r["world"], r["micro"], r["gas"], r["batch"]) for r in records]
    # three rounds: 4 ranks; after the loss, 2 ranks (one restart counted); node-b back, 4 ranks again
    assert list(dict.fromkeys(rounds)) == [("0", 4, 4, 1, 16), ("1", 2, 4, 2, 16), ("1", 4, 4, 1, 16)], rounds
    shrunk = [r for r in records if r["world"] == 2]
    grown = [r for r in records if r["restart"] == "1" and r["world"] == 4]
    first_round_last = max(r["step"] for r in records if r["restart"] == "0")
    # each restart resumed from the latest checkpoint: the last step logged, or one saved just before the kill
    assert shrunk[0]["resumed"] in (first_round_last, first_round_last + 1)
    assert shrunk[0]["tag"] == f"global_step{shrunk[0]['resumed']}" and shrunk[0]["step"] == shrunk[0]["resumed"] + 1
    assert grown[0]["resumed"] in (shrunk[-1]["step"], shrunk[-1]["step"] + 1)
    assert grown[-1]["step"] == STEPS
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps))  # no step trained twice, none after another round's

    reference = _reference_losses(STEPS)
    for r in records:
        assert r["loss"] == pytest.approx(reference[r["step"] - 1], rel=1e-5), (r, reference)

    assert "failure restart 1 of at most 3: node 1 (node-b) exited with code 137" in err, err
    assert "admitted node-a; not admitted: node-b" in err, err
    assert "starting 2 rank(s) on 1 node(s) (node-a: 2)" in err, err
    assert "membership restart (not counted against --max_restarts): node-b joined: the world grows from 2 to 4" \
        in err, err
    assert "finished: every rank of the 4-rank world succeeded" in err, err
