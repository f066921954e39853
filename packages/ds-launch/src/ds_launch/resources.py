"""Which hosts and slots a launch uses: hostfiles, include/exclude filters, local accelerators.

A *resource map* is an ordered ``dict`` from hostname to the sorted list of slot ids used on it.
Its order is the node order: node 0 is the first host, and global ranks are numbered host by host.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket

DEFAULT_HOSTFILE = "/job/hostfile"

# Names that are safe on a command line: letters, digits, '.', '_', '-', never a leading '-'
# (which ssh or pdsh would take for an option).
_HOSTNAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*\Z")
_DIGITS = re.compile(r"[0-9]+\Z")  # str.isdigit() also takes '²', which int() refuses
MAX_SLOTS = 4096  # processes per host; a typo such as slots=10000000000 must not exhaust memory
# 'host slots=N', then anything (Open MPI's 'max_slots=M', say): DeepSpeed reads the same lines.
_HOSTFILE_LINE = re.compile(r"(?P<host>\S+)\s+slots\s*=\s*(?P<slots>\S+)(?:\s.*)?\Z")


class LaunchError(ValueError):
    """Bad input to the launcher: a one-line message, reported with exit code 2.

    A ``ValueError``, as DeepSpeed's launcher raises for a bad hostfile line or resource filter, so
    ``except ValueError`` written for DeepSpeed's helpers catches ours."""


Resources = dict[str, list[int]]


def check_hostname(name: str, where: str, allow_ip: bool = False) -> str:
    if allow_ip:
        try:
            ipaddress.ip_address(name)
            return name
        except ValueError:
            pass
    if not _HOSTNAME.match(name):
        raise LaunchError(
            f"{where}: invalid hostname {name!r}; a hostname may hold only letters, digits, "
            "'.', '_' and '-', and must not start with '-'"
        )
    return name


def read_lines(path: str, what: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().splitlines()
    except OSError as e:
        raise LaunchError(f"cannot read {what} {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise LaunchError(f"cannot read {what} {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def parse_hostfile(path: str) -> Resources:
    """Read a DeepSpeed hostfile: ``hostname slots=N`` per line; ``#`` comments and blank lines ok;
    words after ``slots=N`` (Open MPI's ``max_slots=M``) are ignored, as DeepSpeed ignores them.
    Bad lines raise `LaunchError`, a ``ValueError`` naming the file, line and value."""
    resources: Resources = {}
    for number, raw in enumerate(read_lines(path, "hostfile"), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"hostfile {path} line {number}"
        m = _HOSTFILE_LINE.match(line)
        if not m:
            raise LaunchError(f"{where}: expected 'hostname slots=N', got {raw.strip()!r}")
        host = check_hostname(m["host"], where)
        if not _DIGITS.match(m["slots"]) or not 1 <= int(m["slots"]) <= MAX_SLOTS:
            raise LaunchError(f"{where}: slots must be an integer from 1 to {MAX_SLOTS}, got {m['slots']!r}")
        if host in resources:
            raise LaunchError(f"{where}: host {host!r} is listed twice")
        resources[host] = list(range(int(m["slots"])))
    if not resources:
        raise LaunchError(f"hostfile {path} names no host")
    return resources


def _parse_filter(spec: str, option: str, available: Resources) -> dict[str, list[int] | None]:
    """``host1:0,1@host2`` → ``{"host1": [0, 1], "host2": None}`` (None: every slot)."""
    parsed: dict[str, list[int] | None] = {}
    for part in spec.split("@"):
        host, sep, slot_text = part.partition(":")
        if not host:
            raise LaunchError(f"{option} {spec!r}: empty host name; expected 'host[:slot,...][@host...]'")
        if host not in available:
            known = ", ".join(available)
            raise LaunchError(f"{option} {spec!r}: host {host!r} is not among the hosts ({known})")
        if not sep:
            parsed[host] = None
            continue
        slots: list[int] = []
        for token in slot_text.split(","):
            if not _DIGITS.match(token):
                raise LaunchError(f"{option} {spec!r}: slot {token!r} of host {host!r} is not a non-negative integer")
            slot = int(token)
            if slot not in available[host]:
                raise LaunchError(
                    f"{option} {spec!r}: host {host!r} has no slot {slot} (its slots: {_span(available[host])})"
                )
            slots.append(slot)
        if host in parsed and parsed[host] is None:
            continue  # already every slot
        parsed[host] = sorted(set(parsed.get(host) or []) | set(slots))
    return parsed


def _span(slots: list[int]) -> str:
    return ",".join(map(str, slots))


def select_resources(
    available: Resources,
    include: str = "",
    exclude: str = "",
    num_nodes: int | None = None,
    num_procs: int | None = None,
) -> Resources:
    """Apply DeepSpeed's resource options to the hosts of a hostfile, keeping the host order."""
    if include and exclude:
        raise LaunchError("--include and --exclude cannot be used together")
    if (include or exclude) and (num_nodes is not None or num_procs is not None):
        raise LaunchError("--num_nodes/--num_gpus cannot be combined with --include/--exclude")
    if include:
        chosen = _parse_filter(include, "--include", available)
        active = {h: list(slots) if chosen[h] is None else chosen[h] for h, slots in available.items() if h in chosen}
    elif exclude:
        dropped = _parse_filter(exclude, "--exclude", available)
        active = {}
        for host, slots in available.items():
            if host in dropped:
                removed = dropped[host]
                slots = [] if removed is None else [s for s in slots if s not in removed]
            if slots:
                active[host] = list(slots)
    else:
        active = {h: list(s) for h, s in available.items()}
    if num_nodes is not None:
        if num_nodes > len(active):
            raise LaunchError(f"--num_nodes {num_nodes} asks for more nodes than the {len(active)} available")
        active = dict(list(active.items())[:num_nodes])
    if num_procs is not None:
        for host, slots in active.items():
            if num_procs > len(slots):
                raise LaunchError(
                    f"--num_gpus {num_procs} asks for more processes than host {host!r} has slots ({len(slots)})"
                )
            active[host] = slots[:num_procs]
    if not active:
        raise LaunchError("the resource filters leave no host to run on")
    return active


def local_accelerators(environ: dict[str, str] | None = None) -> list[str]:
    """Ids of the NVIDIA GPUs this process may use, found without importing torch: the entries of
    CUDA_VISIBLE_DEVICES when it is set (indices or UUIDs), else 0..n-1 for the /dev/nvidiaN
    devices; empty on a machine without GPUs. Slot i of a host maps to the i-th id."""
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        return [] if not entries or entries[0] in ("-1", "NoDevFiles") else entries
    try:
        names = os.listdir("/dev")
    except OSError:
        return []
    return [str(i) for i in range(sum(1 for n in names if re.fullmatch(r"nvidia\d+", n)))]


def is_local_address(name: str) -> bool:
    """True when ``name`` is certainly this machine (a loopback address or this host's name); no DNS."""
    if name in ("localhost", socket.gethostname()):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def check_port_free(address: str, port: int) -> None:
    """Fail early, with a clear message, when the rendezvous port is taken on this machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # Like torch's TCPStore: SO_REUSEADDR, so a TIME_WAIT leftover does not count as taken.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as e:
            raise LaunchError(
                f"--master_port {port} is already in use on {address} ({e.strerror}); "
                "stop the process that holds it or choose another port with --master_port"
            ) from None
