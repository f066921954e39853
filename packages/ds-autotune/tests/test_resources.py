"""DeepSpeed's side of the autotuner's API: `ResourceManager` (the pool of hosts and slots, the arg mappings),
`launcher_options` (an `Autotuner` from a launcher's parsed command line and the resources it selected, with
DeepSpeed's ``exp_num_nodes``/``exp_num_gpus``), and the nested-key helpers the arg mappings use."""

import argparse
import json
import os
from pathlib import Path

import pytest

from ds_autotune import Autotuner, ResourceManager, get_val_by_key, launcher_options, set_val_by_key

FAKE = str(Path(__file__).with_name("_fake_train.py"))


# ----------------------------------------------------------------------------------------- ResourceManager
@pytest.mark.parametrize("mappings, expected", [
    (None, {}),
    ({}, {}),
    ({" train_micro_batch_size_per_gpu ": " --per_device_train_batch_size"},
     {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size"}),
    ({"train_batch_size": "-tbs", " train_batch_size": "--other"}, {"train_batch_size": "-tbs"}),  # first wins
])
def test_arg_mappings_are_stripped_and_the_first_of_equal_keys_wins(mappings, expected):
    rm = ResourceManager(args=None, hosts="worker-0, worker-1", num_gpus_per_node=4, results_dir=None,
                         exps_dir=None, arg_mappings=mappings)
    assert rm.arg_mappings == expected


@pytest.mark.parametrize("kwargs, words", [
    ({"arg_mappings": {"train_batch_size": 8}}, ["arg_mappings", "8"]),
    ({"arg_mappings": {"train_batch_size": "  "}}, ["arg_mappings", "non-empty"]),
    ({"num_gpus_per_node": 0}, ["num_gpus_per_node", "0"]),
    ({"hosts": "worker-0,,worker-1"}, ["hosts", "non-empty"]),
    ({"hosts": ["worker-0", "worker-0"]}, ["'worker-0'", "more than once"]),
    ({"hosts": 3}, ["hosts", "3"]),
])
def test_bad_resource_manager_input_is_named(kwargs, words):
    given = {"args": None, "hosts": ["worker-0"], "num_gpus_per_node": 2, "results_dir": None, "exps_dir": None,
             "arg_mappings": None, **kwargs}
    with pytest.raises(ValueError) as e:
        ResourceManager(**given)
    for word in words:
        assert word in str(e.value), (word, str(e.value))


def test_hosts_as_a_comma_separated_string_are_host_names():
    rm = ResourceManager(None, "worker-0, worker-1", 4, "res", "exps", None)
    assert [(n.host, n.slots) for n in rm.nodes] == [("worker-0", (0, 1, 2, 3)), ("worker-1", (0, 1, 2, 3))]
    assert (rm.num_gpus_per_node, rm.results_dir, rm.exps_dir, rm.args) == (4, "res", "exps", None)


@pytest.mark.parametrize("active, nodes, gpus", [
    ({"worker-0": [0, 1, 2, 3]}, 1, 4),
    ({"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}, 2, 4),
    ({"worker-0": [0], "worker-1": [0, 1, 2], "worker-2": [0, 1, 2]}, 3, 1),
    ({"worker-0": [0, 1], "worker-2": [4, 5]}, 2, 2),
])
def test_the_pool_of_active_resources(active, nodes, gpus):
    rm = ResourceManager.from_active_resources(active)
    assert [n.host for n in rm.nodes] == list(active) and rm.num_gpus_per_node == gpus
    assert rm.experiment_resources() == rm.experiment_resources(-1, -1) == (nodes, gpus)
    assert rm.experiment_resources(1, 1) == (1, 1)
    # an experiment's slots are the real ids, the first ones of each host
    assert rm.select(nodes, gpus) == {host: ids[:gpus] for host, ids in active.items()}


def test_include_names_the_real_slot_ids():
    rm = ResourceManager.from_active_resources({"worker-0": [0, 1, 7], "worker-2": [4, 5]})
    assert rm.include(2, 2) == "worker-0:0,1@worker-2:4,5"
    assert rm.include(1, 1) == "worker-0:0"


@pytest.mark.parametrize("nodes, gpus, words", [(3, 1, ["--num_nodes 3", "2 available"]),
                                                (1, 3, ["--num_gpus 3", "2 every"])])
def test_more_than_the_pool_is_an_error(nodes, gpus, words):
    rm = ResourceManager.from_active_resources({"worker-0": [0, 1], "worker-1": [0, 1]})
    with pytest.raises(ValueError) as e:
        rm.experiment_resources(nodes, gpus)
    for word in words:
        assert word in str(e.value)


@pytest.mark.parametrize("active, words", [({}, ["active_resources"]), ({"w": []}, ["'w'", "no slot"]),
                                           ({"w": [0, 0]}, ["'w'", "twice"]), ({"w": "0,1"}, ["'w'", "'0,1'"])])
def test_bad_active_resources_are_named(active, words):
    with pytest.raises(ValueError) as e:
        ResourceManager.from_active_resources(active)
    for word in words:
        assert word in str(e.value)


# ----------------------------------------------------------------------------------------- nested keys
def test_get_val_by_key_searches_every_nested_dict():
    exp = {"optimizer": {"type": "Adam"}, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    assert get_val_by_key(exp, "device") == "cpu"  # in the second subdict, two levels down
    assert get_val_by_key(exp, "type") == "Adam"
    assert get_val_by_key(exp, "missing") is None
    assert get_val_by_key({"a": 1, "b": {"a": 2}}, "a") == 1  # the outer level first
    with pytest.raises(ValueError, match="dict"):
        get_val_by_key([("a", 1)], "a")


def test_set_val_by_key_sets_every_occurrence_and_adds_none():
    d = {"stage": 0, "zero_optimization": {"stage": 1, "inner": {"stage": 2}}, "other": {"x": 1}}
    set_val_by_key(d, "stage", 3)
    assert d == {"stage": 3, "zero_optimization": {"stage": 3, "inner": {"stage": 3}}, "other": {"x": 1}}
    set_val_by_key(d, "missing", 1)
    assert "missing" not in json.dumps(d)
    nested = {"a": {"a": 1}}
    set_val_by_key(nested, "a", {"a": 5})  # the new value is not searched (it would be put inside itself)
    assert nested == {"a": {"a": 5}}


# ----------------------------------------------------------------------------------------- launcher_options
def _args(config, **kw):
    """A launcher's parsed command line, as deepspeed.launcher.runner.parse_args gives it."""
    fields = {"user_script": FAKE, "user_args": ["--deepspeed_config", config], "num_nodes": -1, "num_gpus": -1,
              "hostfile": None, "include": "", "exclude": "", "launcher": None, "launcher_args": "",
              "master_addr": "", "ssh_port": None, "bind_cores_to_rank": False, "bind_core_list": None,
              "force_multi": False, "module": False, "no_python": False, "no_local_rank": False}
    return argparse.Namespace(**{**fields, **kw})


def _config(tmp_path, **autotuning):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": [2, 8], "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 1},
        "autotuning": {"enabled": True, "results_dir": str(tmp_path / "results"), "exps_dir": str(tmp_path / "exps"),
                       "tuner_type": "gridsearch", "model_info": {"num_params": 1000}, **autotuning}}))
    return str(path)


@pytest.mark.parametrize("active", [{"worker-0": [0, 1, 2, 3]}, {"worker-0": [0], "worker-1": [0, 1, 2]},
                                    {"worker-0": [0, 1], "worker-2": [4, 5]}])
def test_experiments_use_every_active_node_and_the_smallest_slot_count(tmp_path, active):
    tuner = Autotuner(**launcher_options(_args(_config(tmp_path)), active))
    assert tuner.exp_num_nodes == len(active)
    assert tuner.exp_num_gpus == min(len(v) for v in active.values())
    assert tuner.total_gpus == tuner.exp_num_nodes * tuner.exp_num_gpus


def test_the_command_lines_numbers_win_and_pick_the_first_hosts_and_slots(tmp_path):
    active = {"worker-0": [0, 1], "worker-2": [4, 5]}
    tuner = Autotuner(**launcher_options(_args(_config(tmp_path), num_nodes=1, num_gpus=1), active))
    assert (tuner.exp_num_nodes, tuner.exp_num_gpus) == (1, 1)
    assert "--include=worker-0:0" in tuner.runner.command({"ds_config": {}}, "c.json")
    tuner = Autotuner(**launcher_options(_args(_config(tmp_path), num_nodes=2), active))
    cmd = tuner.runner.command({"ds_config": {}}, "c.json")
    assert "--include=worker-2:4,5" not in cmd and "--include=worker-0:0,1@worker-2:4,5" in cmd


def test_asking_for_more_than_the_active_resources_is_an_error_before_any_directory(tmp_path):
    with pytest.raises(ValueError, match="--num_gpus 4"):
        Autotuner(**launcher_options(_args(_config(tmp_path), num_gpus=4), {"worker-0": [0, 1]}))
    assert not (tmp_path / "results").exists() and not (tmp_path / "exps").exists()


def test_launcher_options_pass_the_launchers_settings_on_but_not_its_filters(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("worker-0 slots=2\nworker-1 slots=2\n")
    args = _args(_config(tmp_path), hostfile=str(hostfile), include="worker-0@worker-1", launcher="openmpi",
                 launcher_args="-mca btl_tcp_if_include eth1", bind_cores_to_rank=True, num_gpus=2)
    options = launcher_options(args, {"worker-0": [0, 1], "worker-1": [0, 1]})
    assert options["launcher_args"] == [f"--hostfile={hostfile}", "--launcher=openmpi",
                                        "--launcher_args=-mca btl_tcp_if_include eth1", "--bind_cores_to_rank"]
    assert (options["num_gpus"], options["num_nodes"]) == (2, None)
    with pytest.raises(ValueError, match="'/no/such/hostfile'"):
        launcher_options(_args("c.json", hostfile="/no/such/hostfile"), {"w": [0]})
    with pytest.raises(ValueError, match="user_args"):
        launcher_options(argparse.Namespace(user_script="x.py"), {"w": [0]})


def test_filters_in_launcher_args_clash_with_active_resources(tmp_path):
    with pytest.raises(ValueError, match="--include"):
        Autotuner(FAKE, ["--deepspeed_config", _config(tmp_path)], active_resources={"w": [0]},
                  launcher_args=["--include=w:0"])


def test_tuning_on_this_machines_active_slots_runs_each_experiment_on_them(tmp_path, monkeypatch):
    """End to end through ds-launch: {"localhost": [0, 1]} gives 2 ranks per experiment; the arg mapping of a
    nested key (zero_optimization.stage) reaches the script's command line."""
    monkeypatch.setenv("FAKE_TRAIN_LOG", str(tmp_path / "runs.log"))
    config = _config(tmp_path, arg_mappings={"stage": "--zero_stage"})
    tuner = Autotuner(**launcher_options(_args(config), {"localhost": [0, 1]}))
    assert (tuner.exp_num_nodes, tuner.exp_num_gpus) == (1, 2)
    best = tuner.tune()
    assert best is not None and best["ds_config"]["train_micro_batch_size_per_gpu"] == 8
    ran = sorted(p.parent.name for p in (tmp_path / "results").glob("*/cmd.txt"))
    assert ran == ["z1_gas1_tmbspg8", "z1_gas4_tmbspg2"]
    for name in ran:
        cmd = (tmp_path / "results" / name / "cmd.txt").read_text()
        assert "--num_gpus=2" in cmd and "--zero_stage 1" in cmd, cmd
        cfg = json.loads((tmp_path / "results" / name / "ds_config.json").read_text())
        assert cfg["train_batch_size"] == 2 * cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"]
    assert os.path.isdir(tmp_path / "exps")
    tuner.write_optimal_config()  # DeepSpeed's two steps: the optimal config, then (here) the summary
    optimal = json.loads((tmp_path / "results" / "ds_config_optimal.json").read_text())
    assert optimal["train_micro_batch_size_per_gpu"] == 8 and "autotuning" not in optimal
    assert "--zero_stage 1" in (tmp_path / "results" / "cmd_optimal.txt").read_text()
    assert not (tmp_path / "results" / "summary.txt").exists()
    assert "z1_gas1_tmbspg8 is the optimal setup" in tuner.write_summary()
    assert (tmp_path / "results" / "summary.txt").is_file() and (tmp_path / "results" / "results.json").is_file()
