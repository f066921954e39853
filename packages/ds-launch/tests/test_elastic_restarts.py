"""Elastic launches with real processes and no torch: a lost node restarts every rank at a smaller
allowed size, a node that comes back is admitted at the next restart, restarts are bounded by
--max_restarts, each restart is logged with its cause, and nothing is left running.

"ssh" here is a stand-in on PATH that runs the remote command on this machine, unless the host is
marked down (a file named after it), when it fails as ssh does (exit 255); the real-ssh version of
these runs is packages/ds-all/tests/test_elastic_launch.py."""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap

import pytest

FAKE_SSH = textwrap.dedent("""\
    #!{python}
    import os, sys
    args = sys.argv[1:]
    host, command = args[args.index("--") + 1], args[args.index("--") + 2:]
    if os.path.exists(os.path.join(os.environ["FAKE_SSH_DOWN"], host)):
        sys.stderr.write(f"ssh: connect to host {{host}} port 22: Connection refused\\n")
        sys.exit(255)
    os.execvp("sh", ["sh", "-c", " ".join(command)])
""")

# Records what each rank of each round saw, then acts out the scenario named by its first argument.
RANK_PROGRAM = textwrap.dedent("""
    import json, os, signal, sys, time
    scenario, out = sys.argv[-5], sys.argv[-1]
    env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "CROSS_RANK", "TORCHELASTIC_RESTART_COUNT",
                                      "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID")}
    restart, world, node = int(env["TORCHELASTIC_RESTART_COUNT"]), int(env["WORLD_SIZE"]), int(env["CROSS_RANK"])
    with open(os.path.join(out, f"restart{restart}_world{world}_rank{env['RANK']}.json"), "w") as f:
        json.dump(env, f)
    down = os.environ["FAKE_SSH_DOWN"]
    if scenario == "lose-and-regain":
        if restart == 0 and node == 1:  # node 1 (node-b) goes away: its host down, its ranks dead
            open(os.path.join(down, "node-b"), "w").close()
            sys.exit(7)
        if restart == 1 and world == 2 and env["RANK"] == "0":
            time.sleep(0.5)
            os.remove(os.path.join(down, "node-b"))  # node-b is back
        if restart == 1 and world == 4:
            sys.exit(0)
    elif scenario == "always-fails":
        sys.exit(3 if env["RANK"] == "0" else 0)
    elif scenario == "succeeds":
        sys.exit(0)
    while True:  # wait to be stopped
        signal.pause()
""")

CONFIG = {"elasticity": {"enabled": True, "max_train_batch_size": 16, "micro_batch_sizes": [2, 4], "min_gpus": 1,
                         "max_gpus": 4, "version": 0.1}}  # allowed world sizes: 1, 2, 4


@pytest.fixture
def elastic(tmp_path, run_launcher, marker):
    """Run an elastic launch over the hostfile text with the fake ssh; (result, records by round)."""
    bin_dir, down, out = tmp_path / "bin", tmp_path / "down", tmp_path / "out"
    for d in (bin_dir, down, out):
        d.mkdir()
    ssh = bin_dir / "ssh"
    ssh.write_text(FAKE_SSH.format(python=sys.executable))
    ssh.chmod(ssh.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "program.py").write_text(RANK_PROGRAM)
    (tmp_path / "cfg.json").write_text(json.dumps(CONFIG))

    def run(hostfile: str, scenario: str, *options: str, down_hosts=()):
        (tmp_path / "hostfile").write_text(hostfile)
        for host in down_hosts:
            (down / host).write_text("")
        result = run_launcher("--hostfile", "hostfile", "--elastic_training", "--master_addr", "127.0.0.1",
                              "--monitor_interval", "0.2", "--kill_grace", "2", *options, "program.py", scenario,
                              "--deepspeed_config", "cfg.json", marker, str(out), cwd=tmp_path, timeout=60,
                              env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_SSH_DOWN": str(down)})
        records = sorted(p.name for p in out.iterdir())
        return result, records

    return run


def test_a_lost_node_shrinks_the_world_and_a_node_coming_back_grows_it(elastic):
    result, records = elastic("node-a slots=2\nnode-b slots=2\n", "lose-and-regain", "--max_restarts", "5")
    log = result.stderr
    assert result.returncode == 0, log
    rounds = sorted({r.rsplit("_rank", 1)[0] for r in records})
    assert rounds == ["restart0_world4", "restart1_world2", "restart1_world4"]
    # (in the first round node-b's dying ranks may take the others down before they write)
    assert [r for r in records if r.startswith("restart1_")] == [
        "restart1_world2_rank0.json", "restart1_world2_rank1.json", *(f"restart1_world4_rank{i}.json" for i in range(4))]
    assert "failure restart 1 of at most 5: node 1 (node-b) exited with code 7" in log
    assert "rendezvous: admitted node-a; not admitted: node-b (ssh: connect to host node-b port 22: " \
           "Connection refused)" in log
    assert "starting 2 rank(s) on 1 node(s) (node-a: 2)" in log
    assert "membership restart (not counted against --max_restarts): node-b joined: the world grows from 2 to 4" in log
    assert "finished: every rank of the 4-rank world succeeded" in log
    assert log.index("failure restart 1") < log.index("membership restart") < log.index("finished")


def test_restarts_are_bounded_by_max_restarts(elastic, tmp_path):
    result, records = elastic("node-a slots=1\nnode-b slots=1\n", "always-fails", "--max_restarts", "2")
    assert result.returncode == 3, result.stderr
    assert [r for r in records if r.endswith("rank0.json")] == [f"restart{i}_world2_rank0.json" for i in range(3)]
    log = result.stderr
    assert "failure restart 1 of at most 2: node 0 (node-a) exited with code 3" in log
    assert "failure restart 2 of at most 2" in log
    assert "giving up after 2 failure restart(s) (--max_restarts 2): node 0 (node-a) exited with code 3" in log
    env = json.loads((tmp_path / "out" / "restart2_world2_rank0.json").read_text())
    assert env["TORCHELASTIC_MAX_RESTARTS"] == "2" and env["TORCHELASTIC_RUN_ID"]


def test_the_world_takes_the_largest_allowed_size_and_says_so(elastic):
    result, records = elastic("node-a slots=1\nnode-b slots=1\nnode-c slots=1\n", "succeeds")
    assert result.returncode == 0, result.stderr
    assert records == ["restart0_world2_rank0.json", "restart0_world2_rank1.json"]
    assert "3 slot(s) are up but the elasticity config allows world sizes [1, 2, 4]: using 2, the largest allowed " \
           "size below 3 (node-a: 1, node-b: 1)" in result.stderr


def test_a_rendezvous_without_enough_hosts_gives_up_in_time(elastic):
    result, records = elastic("node-a slots=1\nnode-b slots=1\n", "succeeds", "--min_nodes", "2",
                              "--elastic_timeout", "1", down_hosts=["node-b"])
    assert result.returncode == 2 and records == []
    assert "elastic rendezvous gave up after 1 s: up: node-a; down: node-b (ssh: connect to host node-b port 22: " \
           "Connection refused); needed at least min_nodes 2" in result.stderr
