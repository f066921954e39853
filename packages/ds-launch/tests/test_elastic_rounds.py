"""Elastic launches without processes: the world size a round takes (always one the elasticity config
allows, the largest that fits), the rendezvous (admission, min/max nodes, a bounded wait), the training
config's allowed sizes, and the command line's errors."""

from __future__ import annotations

import json
import math

import pytest

from ds_launch import LaunchError
from ds_launch._elastic import ElasticOptions, allowed_sizes, config_path, fit_world, rendezvous
from ds_launch._elasticity import elastic_rank_counts
from ds_launch.cli import main


def test_the_world_is_the_largest_allowed_size_the_slots_hold():
    hosts = {"a": [0, 1], "b": [0, 1], "c": [0, 1]}
    assert fit_world(hosts, [1, 2, 4, 6]) == (hosts, None)
    world, note = fit_world(hosts, [1, 2, 4])
    assert world == {"a": [0, 1], "b": [0, 1]}  # hosts filled in order, the last one idle
    assert "6 slot(s) are up" in note and "using 4, the largest allowed size below 6" in note
    world, note = fit_world({"a": [0, 1], "b": [0, 1]}, [3])
    assert world == {"a": [0, 1], "b": [0]} and "using 3" in note  # a host may run fewer ranks than slots
    assert fit_world({"a": [0]}, [2, 4]) == ({}, "1 slot(s) are up but the smallest world size the elasticity "
                                                 "config allows is 2 (allowed: [2, 4])")


def _probe(up: set[str]):
    asked = []

    def probe(host):
        asked.append(host)
        return (host in up, "" if host in up else "Connection refused")
    return probe, asked


class _Clock:
    def __init__(self):
        self.now = 0.0
        self.sleeps = []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


HOSTS = {"a": [0, 1], "b": [0, 1], "c": [0, 1]}


def test_rendezvous_admits_the_hosts_that_are_up_in_hostfile_order(capsys):
    probe, asked = _probe({"c", "a"})
    world = rendezvous(HOSTS, [1, 2, 4], ElasticOptions(1, 3), probe)
    assert world == {"a": [0, 1], "c": [0, 1]} and sorted(asked) == ["a", "b", "c"]
    assert "admitted a, c; not admitted: b (Connection refused)" in capsys.readouterr().err


def test_rendezvous_takes_at_most_max_nodes():
    probe, _ = _probe({"a", "b", "c"})
    assert rendezvous(HOSTS, [1, 2, 4, 6], ElasticOptions(1, 2), probe) == {"a": [0, 1], "b": [0, 1]}


def test_rendezvous_waits_for_min_nodes_then_admits():
    clock, up = _Clock(), {"a"}

    def probe(host):
        if clock.now >= 3:
            up.add("b")  # b comes up during the wait
        return host in up, "down"
    world = rendezvous(HOSTS, [2, 4], ElasticOptions(2, 3, timeout=10, monitor_interval=1), probe, clock, clock.sleep)
    assert world == {"a": [0, 1], "b": [0, 1]} and clock.sleeps == [1, 1, 1]


def test_rendezvous_gives_up_after_its_timeout():
    clock = _Clock()
    probe, _ = _probe({"a"})
    with pytest.raises(LaunchError, match=r"gave up after 5 s: up: a; down: b \(Connection refused\), "
                                          r"c \(Connection refused\); needed at least min_nodes 2"):
        rendezvous(HOSTS, [1, 2, 4], ElasticOptions(2, 3, timeout=5, monitor_interval=2), probe, clock, clock.sleep)
    assert clock.now == 5  # waits only up to the deadline
    with pytest.raises(LaunchError, match="the smallest world size the elasticity config allows is 8"):
        rendezvous(HOSTS, [8], ElasticOptions(1, 3, timeout=0), probe, clock, clock.sleep)


def _counts(micro, max_batch, low, high):
    """DeepSpeed's documented v0.1 search, written out: the candidate batches are each micro-batch size and their
    LCM scaled by the largest highly composite number within the maximum (a base above it is none: PR 8237); the
    winner has the most device counts g in [low, high] such that some micro-batch size m divides batch / g."""
    hcn = [1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720]
    best = None
    for base in {b for b in set(micro) | {math.lcm(*micro)} if b <= max_batch}:
        batch = max([base] + [base * h for h in hcn if base * h <= max_batch])
        valid = [g for g in range(low, high + 1) if any(batch % g == 0 and (batch // g) % m == 0 for m in micro)]
        if best is None or (len(valid), batch) > (len(best[1]), best[0]):
            best = (batch, valid)
    return best


@pytest.mark.parametrize("micro, max_batch, low, high", [([2, 4], 16, 1, 4), ([3], 24, 1, 8), ([2, 3], 60, 2, 10)])
def test_allowed_rank_counts_v01(micro, max_batch, low, high):
    config = {"elasticity": {"enabled": True, "max_train_batch_size": max_batch, "micro_batch_sizes": micro,
                             "min_gpus": low, "max_gpus": high, "version": 0.1}}
    assert elastic_rank_counts(config, "0.19.8") == _counts(micro, max_batch, low, high)


def test_allowed_rank_counts_v02_are_data_parallel_sizes_times_model_parallel():
    config = {"elasticity": {"enabled": True, "max_train_batch_size": 64, "micro_batch_sizes": [2, 4], "min_gpus": 4,
                             "max_gpus": 16, "num_gpus_per_node": 4, "model_parallel_size": 2, "version": 0.2}}
    # nodes of 4 devices, 2 data-parallel ranks each: the search runs over 1..4 nodes with batch 64 / 2 per node
    node_batch, nodes = _counts([2, 4], 32, 1, 4)
    assert elastic_rank_counts(config, "0.19.8") == (node_batch * 2, [n * 4 for n in nodes])


def test_allowed_sizes_reads_the_training_config(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"train_batch_size": 16, "elasticity": {
        "enabled": True, "max_train_batch_size": 16, "micro_batch_sizes": [2, 4], "min_gpus": 1, "max_gpus": 4,
        "version": 0.1}}))
    assert allowed_sizes(str(path)) == (16, [1, 2, 4])
    assert config_path(["--x", "--deepspeed_config", str(path)]) == str(path)
    assert config_path(["--deepspeed_config=c.json"]) == "c.json" and config_path(["--deepspeed"]) is None
    path.write_text(json.dumps({"elasticity": {"enabled": False}}))
    with pytest.raises(LaunchError, match="does not enable elasticity"):
        allowed_sizes(str(path))
    path.write_text(json.dumps({"elasticity": {"enabled": True, "max_train_batch_size": 16,
                                               "micro_batch_sizes": [32]}}))
    with pytest.raises(LaunchError, match=r"micro_batch_sizes \[32\] must all be <= max_train_batch_size 16"):
        allowed_sizes(str(path))
    with pytest.raises(LaunchError, match=r"pass the script --deepspeed_config cfg\.json"):
        allowed_sizes(None)


@pytest.mark.parametrize("options, message", [
    (["--min_nodes", "2"], "--min_elastic_nodes only apply to an elastic launch: add --elastic_training"),
    (["--max_restarts", "3"], "--max_restarts only apply to an elastic launch"),
    (["--elastic_training", "--launcher", "pdsh"], "--elastic_training needs the ssh launcher"),
    (["--elastic_training", "--node_rank", "0"], "cannot be combined with --node_rank"),
    (["--elastic_training", "--min_nodes", "0"], "--min_elastic_nodes must be a positive number of hosts"),
    (["--elastic_training", "--max_restarts", "-1"], "--max_restarts: must be a number of restarts >= 0, got '-1'"),
    (["--elastic_training", "--min_nodes", "3"], "--min_elastic_nodes 3 is more than the 2 host(s) of the launch"),
    (["--elastic", "--min_nodes", "2", "--max_nodes", "1"], "1 <= --min_elastic_nodes <= --max_elastic_nodes, got 2 and 1"),
    (["--elastic_training", "--monitor_interval", "0"], "--monitor_interval must be more than 0 seconds"),
    (["--elastic_training"], "needs the training config to choose world sizes"),
])
def test_command_line_errors(tmp_path, capsys, options, message):
    (tmp_path / "hostfile").write_text("a slots=1\nb slots=1\n")
    (tmp_path / "train.py").write_text("")
    code = main(["--hostfile", str(tmp_path / "hostfile"), *options, str(tmp_path / "train.py")])
    assert code == 2 and message in capsys.readouterr().err


def test_dry_run_shows_the_elastic_plan(tmp_path, capsys):
    (tmp_path / "hostfile").write_text("a slots=2\nb slots=2\n")
    (tmp_path / "train.py").write_text("")
    (tmp_path / "cfg.json").write_text(json.dumps({"elasticity": {
        "enabled": True, "max_train_batch_size": 16, "micro_batch_sizes": [2, 4], "min_gpus": 1, "max_gpus": 4,
        "version": 0.1}}))
    code = main(["--hostfile", str(tmp_path / "hostfile"), "--elastic_training", "--dry_run", str(tmp_path / "train.py"),
                 "--deepspeed_config", str(tmp_path / "cfg.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "elastic training over a, b: nodes 1..2, global batch 16, allowed world sizes [1, 2, 4], at most 100" in out
    assert "[node 1 (b)] ranks" in out
