"""Hostfiles and resource selection against tables of cases (DeepSpeed's syntax and results)."""

from __future__ import annotations

import pytest

from ds_launch import LaunchError, parse_hostfile, select_resources
from ds_launch.affinity import format_cores, parse_core_list, split_cores

HOSTS = {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3], "worker-2": [0, 1]}


@pytest.mark.parametrize("text, expected", [
    ("worker-0 slots=4\nworker-1 slots=2\n", {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1]}),
    ("# cluster\n\nworker-0 slots=1   # the head\n  worker-1   slots=2\n", {"worker-0": [0], "worker-1": [0, 1]}),
    ("node_a slots = 3\n", {"node_a": [0, 1, 2]}),
    ("10.0.0.1 slots=8\n", {"10.0.0.1": list(range(8))}),
    # words after slots=N (Open MPI's max_slots) are ignored, as DeepSpeed's r'^(\S+)\s+slots=(\d+)' ignores them
    ("worker-0 slots=4 max_slots=8\nworker-1 slots=2\textra words\n", {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1]}),
])
def test_hostfile_parses(tmp_path, text, expected):
    path = tmp_path / "hostfile"
    path.write_text(text)
    result = parse_hostfile(str(path))
    assert result == expected
    assert list(result) == list(expected)  # the order of the file is the node order


@pytest.mark.parametrize("text, message", [
    ("worker-0 slots=4\nworker-1\n", "line 2: expected 'hostname slots=N', got 'worker-1'"),
    ("worker-0 slots=0\n", "line 1: slots must be an integer from 1 to 4096, got '0'"),
    ("worker-0 slots=-2\n", "line 1: slots must be an integer from 1 to 4096, got '-2'"),
    ("worker-0 slots=two\n", "line 1: slots must be an integer from 1 to 4096, got 'two'"),
    ("a slots=1\n\na slots=2\n", "line 3: host 'a' is listed twice"),
    ("-oProxyCommand=touch slots=1\n", "line 1: invalid hostname '-oProxyCommand=touch'"),
    ("$(reboot) slots=1\n", "invalid hostname '$(reboot)'"),
    ("a;b slots=1\n", "invalid hostname 'a;b'"),
    ("# nothing\n\n", "names no host"),
])
def test_hostfile_errors_name_the_line(tmp_path, text, message):
    path = tmp_path / "hostfile"
    path.write_text(text)
    with pytest.raises(LaunchError, match="hostfile") as info:
        parse_hostfile(str(path))
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_unreadable_hostfile(tmp_path):
    with pytest.raises(LaunchError, match=f"cannot read hostfile {tmp_path}"):
        parse_hostfile(str(tmp_path))  # a directory
    with pytest.raises(LaunchError, match=r"cannot read hostfile .*missing"):
        parse_hostfile(str(tmp_path / "missing"))


@pytest.mark.parametrize("include, exclude, nodes, procs, expected", [
    ("", "", None, None, HOSTS),
    ("worker-1", "", None, None, {"worker-1": [0, 1, 2, 3]}),
    ("worker-0:0,2@worker-2", "", None, None, {"worker-0": [0, 2], "worker-2": [0, 1]}),
    ("worker-2@worker-0:1", "", None, None, {"worker-0": [1], "worker-2": [0, 1]}),  # hostfile order kept
    ("worker-0:3,1@worker-0:1", "", None, None, {"worker-0": [1, 3]}),
    ("worker-0:1@worker-0", "", None, None, {"worker-0": [0, 1, 2, 3]}),
    ("", "worker-1", None, None, {"worker-0": [0, 1, 2, 3], "worker-2": [0, 1]}),
    ("", "worker-0:0,1@worker-2:1", None, None, {"worker-0": [2, 3], "worker-1": [0, 1, 2, 3], "worker-2": [0]}),
    ("", "worker-2:0,1", None, None, {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}),
    ("", "", 2, None, {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}),
    ("", "", None, 2, {"worker-0": [0, 1], "worker-1": [0, 1], "worker-2": [0, 1]}),
    ("", "", 1, 3, {"worker-0": [0, 1, 2]}),
])
def test_resource_selection(include, exclude, nodes, procs, expected):
    result = select_resources(HOSTS, include, exclude, nodes, procs)
    assert result == expected
    assert list(result) == list(expected)


@pytest.mark.parametrize("include, exclude, nodes, procs, message", [
    ("worker-9", "", None, None, "--include 'worker-9': host 'worker-9' is not among the hosts"),
    ("worker-0:7", "", None, None, "host 'worker-0' has no slot 7"),
    ("worker-0:x", "", None, None, "slot 'x' of host 'worker-0' is not a non-negative integer"),
    ("worker-0:", "", None, None, "slot '' of host 'worker-0'"),
    ("@worker-0", "", None, None, "empty host name"),
    ("", "worker-3:0", None, None, "--exclude 'worker-3:0': host 'worker-3' is not among the hosts"),
    ("", "worker-0@worker-1@worker-2", None, None, "leave no host"),
    ("worker-0", "worker-1", None, None, "--include and --exclude cannot be used together"),
    ("worker-0", "", 1, None, "cannot be combined with --include/--exclude"),
    ("", "worker-0", None, 1, "cannot be combined with --include/--exclude"),
    ("", "", 4, None, "--num_nodes 4 asks for more nodes than the 3 available"),
    ("", "", None, 3, "--num_gpus 3 asks for more processes than host 'worker-2' has slots (2)"),
])
def test_resource_selection_errors(include, exclude, nodes, procs, message):
    with pytest.raises(LaunchError) as info:
        select_resources(HOSTS, include, exclude, nodes, procs)
    assert message in str(info.value)


@pytest.mark.parametrize("text, cores", [
    ("0", [0]), ("0-3", [0, 1, 2, 3]), ("0-1,4,6-7", [0, 1, 4, 6, 7]), (" 2 , 5-6", [2, 5, 6]),
])
def test_core_list(text, cores):
    assert parse_core_list(text) == cores
    assert parse_core_list(format_cores(cores)) == cores


@pytest.mark.parametrize("text", ["a", "3-1", "1,1", "1-", "-1", ""])
def test_core_list_errors(text):
    with pytest.raises(LaunchError, match="--bind_core_list"):
        parse_core_list(text)


def test_split_cores_is_even_contiguous_and_complete():
    assert split_cores(2, None, list(range(8))) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert split_cores(3, None, list(range(8))) == [(0, 1, 2), (3, 4, 5), (6, 7)]
    assert split_cores(2, "4-7", list(range(8))) == [(4, 5), (6, 7)]
    with pytest.raises(LaunchError, match="cannot bind 3 local ranks to 2 cores"):
        split_cores(3, None, [0, 1])
    with pytest.raises(LaunchError, match=r"names cores 9 that this process may not use \(available: 0-8\)"):
        split_cores(1, "8-9", list(range(9)))


def test_missing_cores_message_stays_short():
    """Every other core available, 10,000 asked for: the ranges are cut, not listed (was 59,000 characters)."""
    with pytest.raises(LaunchError) as info:
        split_cores(1, "0-9999", list(range(0, 64, 2)))
    message = str(info.value)
    assert len(message) < 200, message
    assert message.startswith("--bind_core_list '0-9999' names cores 1,3,5,")
    assert message.endswith(",...)") and "(available: 0,2,4," in message


@pytest.mark.parametrize("visible, count", [("", 0), ("-1", 0), ("0", 1), ("0,1,3", 3), ("GPU-uuid-a,GPU-uuid-b", 2)])
def test_accelerator_count_honours_cuda_visible_devices(visible, count):
    from ds_launch.resources import local_accelerators

    assert len(local_accelerators({"CUDA_VISIBLE_DEVICES": visible})) == count


def test_gpu_nodes_get_their_slots_as_cuda_visible_devices():
    from ds_launch.spec import NodeSpec, Program

    spec = NodeSpec({"a": [0, 1, 2, 3], "b": [1, 3]}, 1, "a", 29500, Program("train.py"))
    plans = spec.plan(visible_devices=["0", "1", "2", "3"])
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == ["1,3", "1,3"]
    assert [(p.rank, p.local_rank) for p in plans] == [(4, 0), (5, 1)]
    assert all("CUDA_VISIBLE_DEVICES" not in p.env for p in spec.plan(visible_devices=[]))
    # an inherited CUDA_VISIBLE_DEVICES=4,5,6,7 (or UUIDs): slot i is its i-th entry
    plans = spec.plan(visible_devices=["4", "5", "6", "GPU-abc"])
    assert plans[0].env["CUDA_VISIBLE_DEVICES"] == "5,GPU-abc"
    with pytest.raises(LaunchError, match=r"host b has slots \[3\] but only 2 visible GPU"):
        spec.plan(visible_devices=["4", "5"])
