"""The node agent: starts this node's ranks and supervises them.

``ds-launch`` runs it in-process for a single node; for multi-node ssh/pdsh launches it runs on
each node as ``python -u -m ds_launch.node --spec <base64> --node_rank N [--watch_stdin]``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading

from .resources import LaunchError, local_accelerators
from .spec import NodeSpec
from .supervise import Supervisor, spawn

PROBE_REPLY = "ds-launch node: ready"  # what --probe prints: the rendezvous admits a host that says it


def run_node(spec: NodeSpec, watch_stdin: bool = False) -> int:
    """Start the ranks of ``spec.node_rank`` and wait for them; returns the launch's exit code."""
    host = spec.hosts[spec.node_rank]
    if spec.cwd:
        try:
            os.chdir(spec.cwd)
        except OSError as e:
            raise LaunchError(f"cannot enter the working directory {spec.cwd} on {host}: {e.strerror}") from None
    environ = {**os.environ, **spec.env}
    plans = spec.plan(visible_devices=local_accelerators(environ))
    if spec.log_dir:
        try:
            os.makedirs(spec.log_dir, exist_ok=True)
        except OSError as e:
            raise LaunchError(f"--enable_each_rank_log {spec.log_dir}: cannot create the directory: {e.strerror}") from None
    name = "ds-launch" if len(spec.world) == 1 else f"ds-launch[node {spec.node_rank} {host}]"
    with Supervisor(spec.kill_grace, name=name) as supervisor:
        for plan in plans:
            log = os.path.join(spec.log_dir, f"rank{plan.rank}.log") if spec.log_dir else None
            supervisor.add(spawn(plan.label, plan.argv, {**environ, **plan.env}, cpus=plan.cpus, log_path=log,
                                 stdin=subprocess.DEVNULL if watch_stdin else None))
        if watch_stdin:
            # Started by ds-launch over ssh/pdsh: our stdin is the connection. EOF means the
            # launcher closed it or died, so the ranks must go too. (Started after the spawns:
            # forking with a second thread running is best avoided.)
            threading.Thread(target=_stop_on_eof, daemon=True).start()
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
    parser.add_argument("--spec", help="the launch, as encoded by ds-launch")
    parser.add_argument("--node_rank", type=int)
    parser.add_argument("--watch_stdin", action="store_true", help="stop every rank when stdin closes")
    parser.add_argument("--probe", action="store_true",
                        help="only say that this node can run an agent (an elastic launch's rendezvous asks)")
    args = parser.parse_args(argv)
    if args.probe:
        print(PROBE_REPLY, flush=True)
        return 0
    if args.spec is None or args.node_rank is None:
        parser.error("--spec and --node_rank are required")
    try:
        return run_node(NodeSpec.decode(args.spec, args.node_rank), watch_stdin=args.watch_stdin)
    except LaunchError as e:
        print(f"ds-launch[node {args.node_rank}]: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
