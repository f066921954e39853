"""`ResourceManager`: the hosts and slots autotuning experiments may use, and the ``arg_mappings`` (config key
-> the script's option) every experiment's command applies (DeepSpeed's class, its constructor included).

DeepSpeed's launcher hands the autotuner the resources it selected (``active_resources``: host -> slot ids,
after ``--hostfile``/``--include``/``--exclude``). Every node counts as having as many slots as the
smallest of them (``num_gpus_per_node``); an experiment uses the first ``num_nodes`` hosts and the first
``num_gpus`` slots of each, by their real ids (``ResourceManager.from_active_resources``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Node:
    """One host of the pool and the slot ids (accelerator indices) experiments may use on it."""

    host: str
    slots: tuple[int, ...]

    @property
    def max_slots(self) -> int:
        return len(self.slots)


class ResourceManager:
    """``ResourceManager(args, hosts, num_gpus_per_node, results_dir, exps_dir, arg_mappings)``.

    ``hosts``: host names (a list, or one comma-separated string); each gets slots ``0..num_gpus_per_node-1``
    unless ``slots`` (host -> slot ids) says which. ``arg_mappings``: config key -> the script's option, keys
    and options stripped of spaces (the first of two keys equal after stripping wins). ``args`` (the launcher's
    parsed command line), ``results_dir`` and ``exps_dir`` are kept as given.
    """

    def __init__(self, args: Any, hosts: Sequence[str] | str, num_gpus_per_node: int, results_dir: str | None,
                 exps_dir: str | None, arg_mappings: Mapping[str, str] | None, *,
                 slots: Mapping[str, Sequence[int]] | None = None) -> None:
        if isinstance(num_gpus_per_node, bool) or not isinstance(num_gpus_per_node, int) or num_gpus_per_node < 1:
            raise ValueError(f"num_gpus_per_node must be an integer >= 1 (no accelerator is available otherwise), "
                             f"got {num_gpus_per_node!r}")
        names = _host_names(hosts)
        slots = dict(slots or {})
        unknown = sorted(set(slots) - set(names))
        if unknown:
            raise ValueError(f"slots names host(s) {', '.join(unknown)} that are not among the hosts {names}")
        nodes = []
        for host in names:
            ids = tuple(_slot_ids(host, slots[host])) if host in slots else tuple(range(num_gpus_per_node))
            if len(ids) < num_gpus_per_node:
                raise ValueError(f"host {host!r} has {len(ids)} slot(s) {list(ids)}, fewer than num_gpus_per_node "
                                 f"{num_gpus_per_node}")
            nodes.append(Node(host, ids[:num_gpus_per_node]))
        self.args = args
        self.nodes: list[Node] = nodes
        self.num_gpus_per_node = num_gpus_per_node
        self.results_dir, self.exps_dir = results_dir, exps_dir
        self.arg_mappings: dict[str, str] = normalize_arg_mappings(arg_mappings)

    @classmethod
    def from_active_resources(cls, active_resources: Mapping[str, Sequence[int]], *, args: Any = None,
                              results_dir: str | None = None, exps_dir: str | None = None,
                              arg_mappings: Mapping[str, str] | None = None) -> ResourceManager:
        """The pool a launcher selected (host -> slot ids, e.g. ``{"worker-0": [0, 1], "worker-1": [4, 5]}``):
        every host, each with as many slots as the smallest of them (its first ones)."""
        if not isinstance(active_resources, Mapping) or not active_resources:
            raise ValueError(f"active_resources must map each host to its slot ids, e.g. {{'worker-0': [0, 1]}}, "
                             f"got {active_resources!r}")
        slots = {host: _slot_ids(host, ids) for host, ids in active_resources.items()}
        empty = [host for host, ids in slots.items() if not ids]
        if empty:
            raise ValueError(f"active_resources gives host(s) {', '.join(map(repr, empty))} no slot: "
                             "no accelerator is available there")
        return cls(args, list(slots), min(len(ids) for ids in slots.values()), results_dir, exps_dir, arg_mappings,
                   slots=slots)

    def experiment_resources(self, num_nodes: int | None = None, num_gpus: int | None = None) -> tuple[int, int]:
        """(nodes, slots per node) of each experiment: the requested numbers (None or <= 0: not requested, as
        the launcher's -1), else every node and every slot of the pool; more than the pool has is an error."""
        nodes = num_nodes if num_nodes is not None and num_nodes > 0 else len(self.nodes)
        gpus = num_gpus if num_gpus is not None and num_gpus > 0 else self.num_gpus_per_node
        if nodes > len(self.nodes):
            raise ValueError(f"--num_nodes {nodes} asks for more nodes than the {len(self.nodes)} available "
                             f"({', '.join(n.host for n in self.nodes)})")
        if gpus > self.num_gpus_per_node:
            raise ValueError(f"--num_gpus {gpus} asks for more slots per node than the {self.num_gpus_per_node} "
                             "every available node has")
        return nodes, gpus

    def select(self, num_nodes: int, num_gpus: int) -> dict[str, list[int]]:
        """The hosts and slot ids of one experiment: the first ``num_nodes`` nodes, the first ``num_gpus``
        slots of each (checked as `experiment_resources` does)."""
        num_nodes, num_gpus = self.experiment_resources(num_nodes, num_gpus)
        return {node.host: list(node.slots[:num_gpus]) for node in self.nodes[:num_nodes]}

    def include(self, num_nodes: int, num_gpus: int) -> str:
        """`select` as the launcher's ``--include`` value, e.g. ``worker-0:0,1@worker-1:4,5``."""
        return "@".join(f"{host}:{','.join(map(str, ids))}" for host, ids in self.select(num_nodes, num_gpus).items())


def _host_names(hosts: Sequence[str] | str) -> list[str]:
    if isinstance(hosts, str):
        hosts = hosts.split(",")
    if not isinstance(hosts, Sequence) or not all(isinstance(h, str) for h in hosts):
        raise ValueError(f"hosts must be host names (a list, or one comma-separated string), got {hosts!r}")
    names = [h.strip() for h in hosts]
    if not names or any(not h or any(c.isspace() for c in h) for h in names):
        raise ValueError(f"hosts must be non-empty host names without spaces, got {hosts!r}")
    twice = sorted({h for h in names if names.count(h) > 1})
    if twice:
        raise ValueError(f"hosts lists {', '.join(map(repr, twice))} more than once: {hosts!r}")
    return names


def _slot_ids(host: str, ids: Any) -> list[int]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) \
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"the slots of host {host!r} must be a list of non-negative integers, got {ids!r}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"the slots of host {host!r} list a slot twice: {list(ids)}")
    return list(ids)


def normalize_arg_mappings(arg_mappings: Mapping[str, str] | None) -> dict[str, str]:
    """``arg_mappings`` with keys and options stripped of spaces, the first of two equal keys kept ({} for None)."""
    if arg_mappings is None:
        return {}
    if not isinstance(arg_mappings, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                        for k, v in arg_mappings.items()):
        raise ValueError("arg_mappings must map config keys to the script's options, e.g. "
                         f'{{"train_micro_batch_size_per_gpu": "--batch_size"}}, got {arg_mappings!r}')
    out: dict[str, str] = {}
    for key, option in arg_mappings.items():
        key, option = key.strip(), option.strip()
        if not key or not option:
            raise ValueError(f"arg_mappings must map non-empty config keys to non-empty options, got "
                             f"{key!r}: {option!r}")
        out.setdefault(key, option)
    return out
