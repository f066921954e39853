"""The node agent: starts this node's ranks and supervises them.

``ds-launch`` runs it in-process for a single node; for multi-node ssh/pdsh launches it runs on
each node as ``python -m ds_launch.node --world_info ... --node_rank N ... -- program args``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading

from .resources import LaunchError, count_local_accelerators
from .spec import NodeSpec, add_program_arguments, decode_world, program_from_args
from .supervise import Supervisor, spawn


def run_node(spec: NodeSpec, watch_stdin: bool = False) -> int:
    """Start the ranks of ``spec.node_rank`` and wait for them; returns the launch's exit code."""
    plans = spec.plan(accelerators=count_local_accelerators())
    if spec.log_dir:
        try:
            os.makedirs(spec.log_dir, exist_ok=True)
        except OSError as e:
            raise LaunchError(f"--enable_each_rank_log {spec.log_dir}: cannot create the directory: {e.strerror}") from None
    host = spec.hosts[spec.node_rank]
    name = "ds-launch" if len(spec.world) == 1 else f"ds-launch[node {spec.node_rank} {host}]"
    with Supervisor(spec.kill_grace, name=name) as supervisor:
        if watch_stdin:
            # Started over ssh: our stdin is the connection. EOF means the launcher closed it or
            # died, so the ranks must go too (the signal handler is in place by now).
            threading.Thread(target=_stop_on_eof, daemon=True).start()
        for plan in plans:
            log = os.path.join(spec.log_dir, f"rank{plan.rank}.log") if spec.log_dir else None
            try:
                supervisor.add(spawn(plan.label, plan.argv, {**os.environ, **plan.env}, cpus=plan.cpus,
                                     log_path=log, stdin=subprocess.DEVNULL if watch_stdin else None))
            except OSError as e:
                raise LaunchError(str(e)) from None
        return supervisor.watch()


def _stop_on_eof() -> None:
    try:
        while os.read(0, 65536):  # the raw fd: a buffered reader's lock would block shutdown
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_launch.node",
                                     description="ds-launch's per-node agent (started by ds-launch).")
    parser.add_argument("--world_info", required=True)
    parser.add_argument("--node_rank", type=int, required=True)
    parser.add_argument("--master_addr", required=True)
    parser.add_argument("--master_port", type=int, required=True)
    parser.add_argument("--kill_grace", type=float, default=5.0)
    parser.add_argument("--bind_cores_to_rank", action="store_true")
    parser.add_argument("--bind_core_list")
    parser.add_argument("--enable_each_rank_log")
    parser.add_argument("--watch_stdin", action="store_true")
    add_program_arguments(parser)
    args = parser.parse_args(argv)
    try:
        world = decode_world(args.world_info)
        if not 0 <= args.node_rank < len(world):
            raise LaunchError(f"--node_rank {args.node_rank} is outside 0..{len(world) - 1}")
        spec = NodeSpec(world, args.node_rank, args.master_addr, args.master_port, program_from_args(args),
                        args.bind_cores_to_rank, args.bind_core_list, args.enable_each_rank_log, args.kill_grace)
        return run_node(spec, watch_stdin=args.watch_stdin)
    except LaunchError as e:
        print(f"ds-launch[node {args.node_rank}]: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
