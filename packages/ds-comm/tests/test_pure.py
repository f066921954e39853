"""Everything that needs no processes: topology arithmetic, config, bit packing, discovery."""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ds_comm
from ds_comm.distributed import _discover, first_slurm_host
from ds_comm.logger import bus_factor


@pytest.mark.parametrize("dims", [[2, 2, 2], [1, 3, 2], [4, 1, 1], [2, 3, 1]])
def test_topology_maps_every_rank_both_ways(dims):
    topo = ds_comm.ProcessTopology(axes=["pipe", "data", "model"], dims=dims)
    assert topo.world_size() == dims[0] * dims[1] * dims[2]
    for rank, (p, d, m) in enumerate(itertools.product(*(range(n) for n in dims))):
        # row-major, the last axis varying fastest (DeepSpeed's layout)
        assert rank == p * dims[1] * dims[2] + d * dims[2] + m
        assert topo.get_rank(pipe=p, data=d, model=m) == rank
        assert tuple(topo.get_coord(rank)) == (p, d, m)
    for axis, n in zip(["pipe", "data", "model"], dims, strict=True):
        lines = topo.get_axis_comm_lists(axis)
        assert sorted(r for line in lines for r in line) == list(range(topo.world_size()))
        for line in lines:
            coords = [topo.get_coord(r) for r in line]
            assert len(line) == n
            assert [getattr(c, axis) for c in coords] == list(range(n))
            others = {tuple(v for a, v in c._asdict().items() if a != axis) for c in coords}
            assert len(others) == 1  # a line differs only along its axis
        for idx in range(n):
            assert topo.get_axis_list(axis, idx) == [r for r in range(topo.world_size())
                                                     if getattr(topo.get_coord(r), axis) == idx]


def test_deepspeeds_pipeline_topologies():
    pipe_data = ds_comm.PipeDataParallelTopology(num_pp=2, num_dp=3)
    assert (pipe_data.axes, pipe_data.dims) == (["pipe", "data"], [2, 3])
    assert pipe_data.get_rank(pipe=1, data=0) == 3  # data-parallel ranks are neighbours
    three_d = ds_comm.PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert (three_d.axes, three_d.dims) == (["pipe", "data", "model"], [2, 2, 2])
    assert three_d.get_rank(pipe=0, data=0, model=1) == 1  # model-parallel ranks are neighbours


def test_topology_errors_name_the_problem():
    with pytest.raises(ValueError, match="every dim must be a positive integer"):
        ds_comm.ProcessTopology(["a", "b"], [2, 0])
    with pytest.raises(ValueError, match="same length"):
        ds_comm.ProcessTopology(["a"], [2, 2])
    topo = ds_comm.ProcessTopology(["pipe", "data"], [2, 2])
    with pytest.raises(ValueError, match=r"data=2 is outside 0\.\.1"):
        topo.get_rank(pipe=0, data=2)
    with pytest.raises(ValueError, match="unknown axis 'model'"):
        topo.get_axis_list("model", 0)
    with pytest.raises(ValueError, match=r"rank 4 is outside 0\.\.3"):
        topo.get_coord(4)


def test_comms_logger_config_defaults_and_errors():
    config = ds_comm.CommsLoggerConfig()
    assert (config.enabled, config.verbose, config.prof_all, config.debug, config.prof_ops, config.hang_timeout) == \
        (False, False, True, False, [], None)
    with pytest.raises(ValueError, match="unknown key 'enable'; did you mean 'enabled'"):
        ds_comm.CommsLoggerConfig.model_validate({"enable": True})
    with pytest.raises(ValueError, match="hang_timeout must be a positive number"):
        ds_comm.CommsLoggerConfig(hang_timeout=0)
    with pytest.raises(ValueError, match=r"unknown op\(s\) \['allreduce'\]"):
        ds_comm.CommsLoggerConfig(prof_ops=["allreduce"])


def test_the_shared_config_section_loads():
    path = Path(__file__).resolve().parents[3].parent / "shared" / "configs" / "profiling_and_monitoring.json"
    if not path.exists():
        pytest.skip(f"{path} is not beside this checkout")
    section = json.loads(path.read_text())["comms_logger"]
    config = ds_comm.CommsLoggerConfig.model_validate(section)
    assert config.model_dump(include=set(section)) == section


@pytest.mark.parametrize("n", [8, 64, 1000, 4096])
def test_sign_bits_round_trip_and_pack_eight_per_byte(n):
    n -= n % 8
    x = torch.randn(n)
    x[::7] = 0.0  # zero counts as +1
    packed = ds_comm.pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == n // 8
    assert torch.equal(ds_comm.unpack_signs(packed), torch.where(x >= 0, 1.0, -1.0))
    # the layout: bit i of byte j is element 8j+i
    assert int(packed[0]) == sum(1 << i for i in range(8) if x[i] >= 0)
    with pytest.raises(ValueError, match="multiple of 8"):
        ds_comm.pack_signs(torch.ones(9))


def test_discovery_sources_and_slurm_hosts():
    assert _discover({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == ("ds-launch/torchrun", 1, 4, 1)
    assert _discover({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}) \
        == ("Open MPI", 3, 8, 1)
    assert _discover({"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"}) == ("SLURM", 2, 4, 0)
    assert _discover({}) is None
    assert first_slurm_host("node[03-05,7],login1") == "node03"
    assert first_slurm_host("gpu-a100-12") == "gpu-a100-12"


def test_init_without_any_rank_source_names_what_it_looked_for(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match=r"RANK\+WORLD_SIZE .*OMPI_COMM_WORLD_RANK.*SLURM_PROCID"):
        ds_comm.init_distributed(dist_backend="gloo")
    with pytest.raises(ValueError, match="dist_backend must be one of gloo, nccl, mpi, ucc, got 'tcp'"):
        ds_comm.init_distributed(dist_backend="tcp")


def test_init_distributed_takes_deepspeeds_arguments_in_deepspeeds_order(monkeypatch):
    import inspect

    assert list(inspect.signature(ds_comm.init_distributed).parameters) == [
        "dist_backend", "auto_mpi_discovery", "distributed_port", "verbose", "timeout", "init_method",
        "dist_init_required", "config", "rank", "world_size"]
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    # dist_init_required=False: the caller owns the process group; nothing is created, nothing is asked
    ds_comm.init_distributed("gloo", dist_init_required=False)
    assert not ds_comm.is_initialized() and "MASTER_PORT" not in os.environ
    # distributed_port (third, as in DeepSpeed) is MASTER_PORT when the environment has none: a group of one
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = (f"import os, ds_comm; ds_comm.init_distributed('gloo', True, {port}, False, rank=0, world_size=1); "
            "print(os.environ['MASTER_PORT'], ds_comm.is_initialized(), ds_comm.get_world_size())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "MASTER_ADDR": "127.0.0.1"})
    assert result.returncode == 0 and result.stdout.split() == [str(port), "True", "1"], result.stdout + result.stderr


def test_calls_before_init_are_named():
    with pytest.raises(RuntimeError, match=r"ds_comm.all_reduce: the process group is not initialised"):
        ds_comm.all_reduce(torch.ones(2))
    with pytest.raises(RuntimeError, match=r"ds_comm.get_rank: the process group is not initialised"):
        ds_comm.get_rank()


def test_bus_bandwidth_factors():
    assert bus_factor("all_reduce", 4) == 1.5
    assert bus_factor("all_gather_into_tensor", 4) == 0.75
    assert bus_factor("reduce_scatter_tensor", 2) == 0.5
    assert bus_factor("broadcast", 8) == 1.0


SRC = Path(ds_comm.__file__).resolve().parent


def _own_imports(path: Path) -> set[str]:
    """The ds_comm modules a module imports, anywhere in it (a function-level import closes a cycle too)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("ds_comm."):
            found.add(node.module.split(".")[1])
    return found


def test_the_modules_import_one_another_without_a_cycle():
    graph = {p.stem: _own_imports(p) for p in SRC.glob("*.py") if p.stem != "__init__"}
    graph = {module: {m for m in imports if m in graph} for module, imports in graph.items()}
    seen, done = set(), set()

    def visit(module, path):
        if module in path:
            raise AssertionError(f"import cycle: {' -> '.join([*path[path.index(module):], module])}")
        if module in done:
            return
        for imported in sorted(graph[module]):
            visit(imported, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
        seen.add(module)
    assert seen == set(graph)
    assert graph["_ops"] == set()  # the op table and bus factors: a leaf the others read


def test_library_code_logs_instead_of_printing():
    import ast

    printing = []
    for path in sorted(SRC.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
                printing.append(f"{path.name}:{node.lineno}")
    assert printing == []


def test_staging_buffers_are_reused_smallest_fit_first_and_bounded():
    from ds_comm.collectives import _Staging

    staging = _Staging()
    cpu = torch.device("cpu")
    small, big = staging.take(100, torch.float32, cpu), staging.take(1000, torch.float32, cpu)
    staging.give_back(big)
    staging.give_back(small)
    assert staging.take(50, torch.float32, cpu) is small  # the smallest that fits
    assert staging.take(50, torch.float32, cpu) is big
    assert staging.take(2000, torch.float32, cpu).numel() == 2000  # none fits: a new one
    assert staging.take(10, torch.float64, cpu).dtype == torch.float64  # per dtype
    for n in range(1, 8):
        staging.give_back(torch.empty(n * 10))
    assert staging.held_bytes() == 4 * (40 + 50 + 60 + 70)  # KEEP=4: the smallest are dropped
    staging.clear()
    assert staging.held_bytes() == 0


def test_configure_takes_the_section_a_whole_config_or_a_file(tmp_path):
    import json

    from ds_config import ConfigError

    import ds_comm

    try:
        assert ds_comm.configure({"enabled": True, "prof_all": False, "prof_ops": ["all_reduce"]}).prof_ops == ["all_reduce"]
        whole = {"train_batch_size": 8, "comms_logger": {"enabled": True, "verbose": True}}
        assert ds_comm.configure(whole).verbose is True
        path = tmp_path / "ds_config.json"
        path.write_text(json.dumps(whole))
        assert ds_comm.configure(str(path), verbose=False).verbose is False
        assert ds_comm.configure({"train_batch_size": 8}).enabled is False  # no section: the defaults
        with pytest.raises(ConfigError, match="unknown section 'comms_loger'; did you mean 'comms_logger'"):
            ds_comm.configure({"comms_loger": {"enabled": True}})
        with pytest.raises(ConfigError, match=r"comms_logger\.enabled: must be true or false, got 2"):
            ds_comm.configure({"enabled": 2})
    finally:
        ds_comm.configure({})
