"""Elastic launches (``--elastic_training``): run the job on the hosts that are up, and restart every
rank at a new size when a node is lost or one joins.

A *round* is one start of every rank. Before each round a rendezvous asks every candidate host (the
hostfile's, after ``--include``/``--exclude``/``--num_nodes``) whether it is up, through the same ssh
path the launch uses (``ssh host python -m ds_launch.node --probe``, each probe bounded by a connect
and a total time limit), and admits those that answer, at most ``max_nodes`` of them in hostfile
order; it waits (up to ``timeout`` seconds) until at least ``min_nodes`` answer. The round's world
size is the largest size the training config's ``elasticity`` section allows (`elastic_rank_counts`)
that the admitted slots can hold: hosts are filled in order, so a smaller allowed size leaves the last
slots (or hosts) idle, and the log says so.

During a round the launcher watches every node's ssh client (which carries its node agent's exit
code) and, every ``monitor_interval`` seconds, probes the candidate hosts that are not in the round.
A node that exits with an error (its ranks died, its agent or its ssh connection was lost) ends the
round: a *failure restart*, counted against ``max_restarts`` (DeepSpeed's elastic agent allows 100).
A host that comes up and lets the world grow to a larger allowed size also ends the round: a
*membership restart*, not counted (as in torchelastic). Either way every rank is stopped (the node
agents get EOF, then their ranks SIGTERM and SIGKILL after the grace) and a new rendezvous starts the
next round, whose ranks resume from the training script's own checkpoint (``load_checkpoint``). Every
restart is logged with its cause. The ranks get torchelastic's ``TORCHELASTIC_RESTART_COUNT`` (failure
restarts so far), ``TORCHELASTIC_MAX_RESTARTS`` and ``TORCHELASTIC_RUN_ID``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ._elasticity import ElasticityError, elastic_rank_counts
from .node import PROBE_REPLY
from .resources import LaunchError, Resources, check_port_free, is_local_address
from .runners import build_commands, ssh_probe_command
from .spec import NodeSpec
from .supervise import Supervisor, exit_code, spawn

TARGET_DEEPSPEED_VERSION = "0.19.8"  # the DeepSpeed release whose elasticity rules the sizes follow
DEFAULT_MAX_RESTARTS = 100  # DeepSpeed's elastic agent (its WorkerSpec's max_restarts)
DEFAULT_TIMEOUT = 100.0  # seconds; DeepSpeed's rendezvous timeout
DEFAULT_MONITOR_INTERVAL = 5.0  # seconds; DeepSpeed's elastic agent's monitor_interval
PROBE_TIMEOUT = 20.0  # seconds for one probe (ssh connect bounded at half of it)
_PORT_WAIT = 30.0  # seconds a round waits for the previous round's rendezvous port to be free
_POLL = 0.05

Probe = Callable[[str], tuple[bool, str]]  # host -> (up, why not)


def _log(message: str) -> None:
    print(f"ds-launch: elastic: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class ElasticOptions:
    min_nodes: int
    max_nodes: int
    max_restarts: int = DEFAULT_MAX_RESTARTS
    timeout: float = DEFAULT_TIMEOUT
    monitor_interval: float = DEFAULT_MONITOR_INTERVAL

    def __post_init__(self):
        if self.min_nodes < 1 or self.max_nodes < self.min_nodes:
            raise LaunchError(f"elastic node counts must satisfy 1 <= --min_elastic_nodes <= --max_elastic_nodes, "
                              f"got {self.min_nodes} and {self.max_nodes}")
        if self.max_restarts < 0:
            raise LaunchError(f"--max_restarts must be >= 0, got {self.max_restarts}")


def check_args(args) -> None:
    """The command line of an elastic launch (``args`` from ds-launch's parser) is consistent."""
    if not args.elastic_training:
        from .cli import ELASTIC_ONLY

        given = [flag for flag, name, default in ELASTIC_ONLY if getattr(args, name) != default]
        raise LaunchError(f"{', '.join(given)} only apply to an elastic launch: add --elastic_training")
    if args.node_rank is not None:
        raise LaunchError("--elastic_training starts and restarts every node itself; it cannot be combined with "
                          "--node_rank")
    if (args.launcher or "ssh") != "ssh":
        raise LaunchError(f"--elastic_training needs the ssh launcher (a node agent per host, whose exit tells a lost "
                          f"node), not --launcher {args.launcher}")
    if args.monitor_interval is not None and args.monitor_interval <= 0:
        raise LaunchError(f"--monitor_interval must be more than 0 seconds, got {args.monitor_interval:g}")


def options_from_args(args, world: Resources) -> ElasticOptions:
    """The elastic options of ``args`` over the candidate hosts ``world``, DeepSpeed's defaults filled in
    (``-1``: 1 node at least, every host at most)."""
    low = 1 if args.min_elastic_nodes == -1 else args.min_elastic_nodes
    high = len(world) if args.max_elastic_nodes == -1 else args.max_elastic_nodes
    if low > len(world):
        raise LaunchError(f"--min_elastic_nodes {low} is more than the {len(world)} host(s) of the launch "
                          f"({', '.join(world)})")
    return ElasticOptions(low, high, DEFAULT_MAX_RESTARTS if args.max_restarts is None else args.max_restarts,
                          DEFAULT_TIMEOUT if args.elastic_timeout is None else args.elastic_timeout,
                          DEFAULT_MONITOR_INTERVAL if args.monitor_interval is None else args.monitor_interval)


# ---------------------------------------------------------------------------------------------------
# The training config: which world sizes keep the global batch


def config_path(user_args: tuple[str, ...] | list[str]) -> str | None:
    """The value of the script's ``--deepspeed_config`` (or ``--deepspeed-config``) argument."""
    args = list(user_args)
    for i, word in enumerate(args):
        for name in ("--deepspeed_config", "--deepspeed-config"):
            if word == name and i + 1 < len(args):
                return args[i + 1]
            if word.startswith(name + "="):
                return word[len(name) + 1:]
    return None


def allowed_sizes(path: str | None) -> tuple[int, list[int]]:
    """``(global batch, allowed world sizes)`` from the ``elasticity`` section of the JSON config at ``path``."""
    if path is None:
        raise LaunchError("--elastic_training needs the training config to choose world sizes: pass the script "
                          "--deepspeed_config cfg.json (a config whose elasticity section is enabled)")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except OSError as e:
        raise LaunchError(f"--elastic_training: cannot read the training config {path}: {e.strerror}") from None
    except ValueError as e:
        raise LaunchError(f"--elastic_training: the training config {path} is not JSON: {e}") from None
    if not isinstance(config, dict) or not (isinstance(config.get("elasticity"), dict)
                                            and config["elasticity"].get("enabled") is True):
        raise LaunchError(f"--elastic_training: the training config {path} does not enable elasticity (add "
                          "\"elasticity\": {\"enabled\": true, ...}); without it a new world size would change "
                          "the global batch")
    try:
        return elastic_rank_counts(config, TARGET_DEEPSPEED_VERSION)
    except ElasticityError as e:
        raise LaunchError(f"--elastic_training: the training config {path}: {e}") from None


def fit_world(admitted: Resources, allowed: list[int]) -> tuple[Resources, str | None]:
    """The largest allowed world the ``admitted`` hosts' slots hold, filling hosts in order, and a note
    when it is smaller than all the slots (``({}, note)`` when even the smallest allowed size does not fit)."""
    total = sum(len(slots) for slots in admitted.values())
    fits = [n for n in allowed if n <= total]
    if not fits:
        return {}, (f"{total} slot(s) are up but the smallest world size the elasticity config allows is "
                    f"{min(allowed)} (allowed: {allowed})")
    target, left, world = max(fits), max(fits), {}
    for host, slots in admitted.items():
        take = min(left, len(slots))
        if take:
            world[host] = slots[:take]
            left -= take
    note = None
    if target < total:
        note = (f"{total} slot(s) are up but the elasticity config allows world sizes {allowed}: using {target}, "
                f"the largest allowed size below {total} ({', '.join(f'{h}: {len(s)}' for h, s in world.items())})")
    return world, note


# ---------------------------------------------------------------------------------------------------
# The rendezvous


def ssh_probe(launcher_args: str, ssh_port: int | None, timeout: float = PROBE_TIMEOUT) -> Probe:
    """A probe that runs the node agent's ``--probe`` on a host over ssh, within ``timeout`` seconds."""

    def probe(host: str) -> tuple[bool, str]:
        argv = ssh_probe_command(host, launcher_args, ssh_port, connect_timeout=timeout / 2)
        try:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
                                  start_new_session=True)
        except subprocess.TimeoutExpired:
            return False, f"no answer within {timeout:g} s"
        except OSError as e:
            return False, f"cannot run ssh: {e.strerror}"
        if done.returncode == 0 and PROBE_REPLY in done.stdout:
            return True, ""
        said = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return False, said[:200]

    return probe


def probe_hosts(hosts: list[str], probe: Probe) -> dict[str, tuple[bool, str]]:
    """Every host's probe result, probed in parallel."""
    if not hosts:
        return {}
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        return dict(zip(hosts, pool.map(probe, hosts), strict=True))


def rendezvous(candidates: Resources, allowed: list[int], options: ElasticOptions, probe: Probe,
               clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> Resources:
    """Admit the candidate hosts that are up (at most ``max_nodes``, in hostfile order), once at least
    ``min_nodes`` are and they hold an allowed world size; the world to run. Waits at most
    ``options.timeout`` seconds, probing again every ``monitor_interval``; then `LaunchError`."""
    deadline = clock() + options.timeout
    while True:
        results = probe_hosts(list(candidates), probe)
        up = [h for h in candidates if results[h][0]][:options.max_nodes]
        down = {h: why for h, (ok, why) in results.items() if not ok}
        world, note = fit_world({h: candidates[h] for h in up}, allowed)
        if len(up) >= options.min_nodes and world:
            gone = f"; not admitted: {', '.join(f'{h} ({why})' for h, why in down.items())}" if down else ""
            _log(f"rendezvous: admitted {', '.join(up)}{gone}")
            if note:
                _log(note)
            return world
        if clock() >= deadline:
            need = f"at least min_nodes {options.min_nodes} host(s)" if len(up) < options.min_nodes else note
            raise LaunchError(f"elastic rendezvous gave up after {options.timeout:g} s: up: {', '.join(up) or 'none'}; "
                              f"down: {', '.join(f'{h} ({why})' for h, why in down.items()) or 'none'}; needed {need}")
        sleep(max(0.0, min(options.monitor_interval, deadline - clock())))


# ---------------------------------------------------------------------------------------------------
# Rounds


@dataclass
class RoundEnd:
    kind: str  # "done" | "failed" | "joined" | "signal"
    code: int = 0
    cause: str = ""


class _JoinWatch:
    """Probes, in a background thread every ``interval`` seconds, the candidates outside the round; says
    whether one that is up would let the world grow."""

    def __init__(self, candidates: Resources, world: Resources, allowed: list[int], options: ElasticOptions,
                 probe: Probe):
        self.candidates, self.world, self.allowed, self.options, self.probe = candidates, world, allowed, options, probe
        self.outside = [h for h in candidates if h not in world]
        self.size = sum(len(s) for s in world.values())
        self.next_at = time.monotonic() + options.monitor_interval
        self.thread: threading.Thread | None = None
        self.found: str | None = None

    def _look(self) -> None:
        results = probe_hosts(self.outside, self.probe)
        joined = [h for h in self.outside if results[h][0]]
        hosts = [h for h in self.candidates if h in self.world or h in joined][:self.options.max_nodes]
        grown, _ = fit_world({h: self.candidates[h] for h in hosts}, self.allowed)
        size = sum(len(s) for s in grown.values())
        if size > self.size:
            self.found = f"{', '.join(h for h in joined if h in grown)} joined: the world grows from {self.size} to " \
                         f"{size} rank(s)"

    def poll(self) -> str | None:
        if self.outside and self.thread is None and time.monotonic() >= self.next_at:
            self.thread = threading.Thread(target=self._look, daemon=True)
            self.thread.start()
        elif self.thread is not None and not self.thread.is_alive():
            self.thread = None
            self.next_at = time.monotonic() + self.options.monitor_interval
        return self.found

    def close(self) -> None:
        if self.thread is not None:
            self.thread.join(timeout=PROBE_TIMEOUT + 5)


def _cause(label: str, code: int) -> str:
    if code == 255:
        return f"{label}: its ssh connection was lost (ssh exit code 255)"
    return f"{label} exited with code {code}"


def run_round(spec: NodeSpec, launcher_args: str, ssh_port: int | None, extra_env: dict[str, str],
              join: _JoinWatch, venv_script: str | None = None) -> RoundEnd:
    """Start every node of ``spec`` over ssh and watch them until all succeed, one fails, a host joins,
    or a stop signal comes; every node agent is stopped before it returns."""
    commands = build_commands("ssh", spec, launcher_args, ssh_port, extra_env=extra_env, venv_script=venv_script)
    with Supervisor(spec.kill_grace) as supervisor:
        for cmd in commands:
            supervisor.add(spawn(cmd.label, cmd.argv, {**os.environ, **cmd.env}, stdin=subprocess.PIPE,
                                 stop_with_eof=True))
        running = list(supervisor.children)
        try:
            while running:
                if supervisor.signal_received is not None:
                    signum = supervisor.signal_received
                    return RoundEnd("signal", 128 + signum, f"got {signal.Signals(signum).name}")
                for child in list(running):
                    if child.exited():
                        code = exit_code(child.reap())
                        running.remove(child)
                        if code:
                            return RoundEnd("failed", code, _cause(child.label, code))
                if not running:
                    break
                joined = join.poll()
                if joined and len(running) == len(supervisor.children):  # not while the job is finishing
                    return RoundEnd("joined", 0, joined)
                time.sleep(_POLL)
            return RoundEnd("done")
        finally:
            supervisor.stop()
            join.close()


def _wait_port(address: str, port: int) -> None:
    """The previous round's rendezvous port, here, is free again (bounded wait)."""
    if not is_local_address(address):
        return
    deadline = time.monotonic() + _PORT_WAIT
    while True:
        try:
            check_port_free(address, port)
            return
        except LaunchError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)


def run_elastic(spec: NodeSpec, options: ElasticOptions, allowed: list[int], launcher_args: str = "",
                ssh_port: int | None = None, master_addr: str = "", probe: Probe | None = None,
                venv_script: str | None = None) -> int:
    """Run ``spec``'s program elastically over ``spec.world`` (the candidate hosts); the exit code."""
    probe = probe or ssh_probe(launcher_args, ssh_port)
    candidates = spec.world
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex
    restarts = 0
    _log(f"candidate hosts {', '.join(candidates)}; nodes {options.min_nodes}..{options.max_nodes}; allowed world "
         f"sizes {allowed}; at most {options.max_restarts} failure restart(s)")
    while True:
        world = rendezvous(candidates, allowed, options, probe)
        master = master_addr or next(iter(world))
        round_spec = dataclasses.replace(spec, world=world, node_rank=0, master_addr=master)
        size = round_spec.world_size
        _log(f"starting {size} rank(s) on {len(world)} node(s) ({', '.join(f'{h}: {len(s)}' for h, s in world.items())}),"
             f" master {master}:{spec.master_port}, TORCHELASTIC_RESTART_COUNT={restarts}")
        _wait_port(master, spec.master_port)
        env = {"TORCHELASTIC_RESTART_COUNT": str(restarts), "TORCHELASTIC_MAX_RESTARTS": str(options.max_restarts),
               "TORCHELASTIC_RUN_ID": run_id}
        end = run_round(round_spec, launcher_args, ssh_port, env, _JoinWatch(candidates, world, allowed, options, probe),
                        venv_script)
        if end.kind == "done":
            _log(f"finished: every rank of the {size}-rank world succeeded")
            return 0
        if end.kind == "signal":
            _log(f"stopped: {end.cause}")
            return end.code
        if end.kind == "joined":
            _log(f"membership restart (not counted against --max_restarts): {end.cause}")
            continue
        if restarts >= options.max_restarts:
            _log(f"giving up after {restarts} failure restart(s) (--max_restarts {options.max_restarts}): {end.cause}")
            return end.code
        restarts += 1
        _log(f"failure restart {restarts} of at most {options.max_restarts}: {end.cause}")
