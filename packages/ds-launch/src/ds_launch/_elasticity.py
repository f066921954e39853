"""DeepSpeed's elastic batch-size computation (``deepspeed.elasticity.compute_elastic_config``), standard
library only, so that the launcher and the engine compute the same thing.

An elastic job fixes one global batch size that many device counts can train with, each through its
own micro-batch size and gradient accumulation (``batch = micro × accumulation × data-parallel ranks``),
so that the job can shrink or grow between restarts without changing what it trains.

Version 0.1: the candidates are each micro-batch size and their least common multiple, each scaled by the
largest highly composite number that keeps it within ``max_train_batch_size``; the winner is the
candidate with the most device counts ``g`` in ``[min_gpus, max_gpus]`` for which some micro-batch size
``m`` divides ``batch / g``, ties going to the larger (``prefer_larger_batch``) or smaller batch.

Version 0.2 works in nodes of ``num_gpus_per_node`` devices, ``model_parallel_size`` of which hold one
model replica: the 0.1 search runs over node counts with the batch per node's data-parallel ranks, and
the valid counts it returns are data-parallel world sizes. A world size outside that list gets the
largest (or smallest) batch within ``max_train_batch_size`` that this world size alone can train with.

A base above ``max_train_batch_size`` (the micro-batch sizes' LCM can be) is no candidate, as in DeepSpeed
since its PR 8237 (0.19.6): the batch never exceeds the maximum. Where DeepSpeed would return a nonsensical result we raise instead: a configuration with no valid
device count, or a world size too large for any batch within the maximum, is an error rather than an
empty list or a batch of 0.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import re
from typing import Any

log = logging.getLogger(__name__)

# The 38 smallest highly composite numbers (more divisors than any smaller number), as DeepSpeed's list:
# a batch size scales by the largest of them that keeps it within the maximum, up to 720720 × the base.
_HIGHLY_COMPOSITE = (1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560,
                     10080, 15120, 20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760, 277200,
                     332640, 498960, 554400, 665280, 720720)

MINIMUM_DEEPSPEED_VERSION = "0.3.8"  # the first DeepSpeed release with elasticity
VERSIONS = (0.1, 0.2)

# DeepSpeed's defaults (the config reference's table)
_DEFAULTS: dict[str, Any] = {
    "enabled": False, "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "min_gpus": 1,
    "max_gpus": 10000, "min_time": 0, "version": 0.2, "prefer_larger_batch": True,
    "ignore_non_elastic_batch_info": False, "num_gpus_per_node": 1, "model_parallel_size": 1,
}


class ElasticityError(ValueError):
    """Base of the elasticity errors (DeepSpeed's name); a ``ValueError``, as every bad-input error of ds."""


class ElasticityConfigError(ElasticityError):
    """The ``elasticity`` section is missing, disabled, or has a bad value (named in the message)."""


class ElasticityIncompatibleWorldSize(ElasticityError):
    """The world size is not one of the device counts the elastic config allows (listed in the message)."""


def _integer(section: dict, key: str, minimum: int) -> int:
    value = section.get(key, _DEFAULTS[key])
    if isinstance(value, float) and value.is_integer():  # JSON's 1e4
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ElasticityConfigError(f"elasticity.{key} must be an integer >= {minimum}, got {value!r}")
    return value


def _boolean(section: dict, key: str) -> bool:
    value = section.get(key, _DEFAULTS[key])
    if not isinstance(value, bool):
        raise ElasticityConfigError(f"elasticity.{key} must be true or false, got {value!r}")
    return value


def _version(value: Any) -> float:
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if number not in VERSIONS:
        raise ElasticityConfigError(f"elasticity.version must be 0.1 or 0.2, got {value!r}")
    return number


class _Section:
    """The checked ``elasticity`` section: every key DeepSpeed reads, with its default."""

    def __init__(self, section: Any):
        if not isinstance(section, dict):
            raise ElasticityConfigError(f"elasticity must be a dictionary, got {type(section).__name__}")
        unknown = sorted(set(section) - set(_DEFAULTS))
        if unknown:
            close = difflib.get_close_matches(unknown[0], list(_DEFAULTS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ElasticityConfigError(f"elasticity.{unknown[0]} is not an elasticity key{hint}; the keys are "
                                        f"{', '.join(_DEFAULTS)}")
        self.enabled = _boolean(section, "enabled")
        if not self.enabled:
            raise ElasticityConfigError("elasticity.enabled is false: enable it (\"enabled\": true) to compute "
                                        "an elastic batch size")
        for key in ("max_train_batch_size", "micro_batch_sizes"):  # no defaults when enabled (DeepSpeed's rule)
            if key not in section:
                raise ElasticityConfigError(f"elasticity.{key} is required when elasticity is enabled")
        self.max_batch = _integer(section, "max_train_batch_size", 1)
        micro = section["micro_batch_sizes"]
        if (not isinstance(micro, list) or not micro
                or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in micro)):
            raise ElasticityConfigError(f"elasticity.micro_batch_sizes must be a non-empty list of positive "
                                        f"integers, got {micro!r}")
        if max(micro) > self.max_batch:
            raise ElasticityConfigError(f"elasticity.micro_batch_sizes {micro} must all be <= "
                                        f"max_train_batch_size {self.max_batch}")
        self.micro = list(micro)
        self.min_gpus = _integer(section, "min_gpus", 1)
        self.max_gpus = _integer(section, "max_gpus", 1)
        if self.min_gpus > self.max_gpus:
            raise ElasticityConfigError(f"elasticity.min_gpus {self.min_gpus} must be <= max_gpus {self.max_gpus}")
        min_time = section.get("min_time", _DEFAULTS["min_time"])
        if isinstance(min_time, bool) or not isinstance(min_time, (int, float)) or not min_time >= 0:
            raise ElasticityConfigError(f"elasticity.min_time must be a number of minutes >= 0, got {min_time!r}")
        self.version = _version(section.get("version", _DEFAULTS["version"]))
        self.prefer_larger = _boolean(section, "prefer_larger_batch")
        _boolean(section, "ignore_non_elastic_batch_info")
        self.gpus_per_node = _integer(section, "num_gpus_per_node", 1)
        self.model_parallel = _integer(section, "model_parallel_size", 1)
        if self.model_parallel > 1 and self.version != 0.2:
            raise ElasticityConfigError(f"elasticity.model_parallel_size {self.model_parallel} needs version 0.2 "
                                        f"(version {section.get('version', _DEFAULTS['version'])!r} has no model "
                                        "parallelism)")
        if self.gpus_per_node % self.model_parallel:
            raise ElasticityConfigError(f"elasticity.num_gpus_per_node {self.gpus_per_node} must be divisible by "
                                        f"model_parallel_size {self.model_parallel}")


def _valid_counts(batch: int, micro: list[int], low: int, high: int) -> list[int]:
    """Device counts in [low, high] that train ``batch`` with one of the micro-batch sizes: the divisors
    of ``batch / m`` for each ``m`` dividing ``batch``."""
    counts: set[int] = set()
    for m in set(micro):
        if batch % m:
            continue
        per = batch // m
        counts.update(d for i in range(1, math.isqrt(per) + 1) if per % i == 0 for d in (i, per // i)
                      if low <= d <= high)
    return sorted(counts)


def _search_v01(micro: list[int], max_batch: int, low: int, high: int, prefer_larger: bool) -> tuple[int, list[int]]:
    # A base above the maximum is skipped (DeepSpeed PR 8237, in DeepSpeed since 0.19.6): scaling only grows
    # it, so it can give no batch within max_train_batch_size. Each micro-batch size is at most the maximum
    # (checked before), so some base remains.
    bases = {base for base in set(micro) | {math.lcm(*micro)} if base <= max_batch}
    candidates = {max([base] + [base * h for h in _HIGHLY_COMPOSITE if base * h <= max_batch]) for base in bases}
    best: tuple[int, int] | None = None  # (number of valid counts, batch), ordered by preference
    for batch in candidates:
        key = (len(_valid_counts(batch, micro, low, high)), batch if prefer_larger else -batch)
        if key[0] and (best is None or key > best):
            best = key
    if best is None:
        raise ElasticityConfigError(f"no batch size <= max_train_batch_size {max_batch} from micro_batch_sizes "
                                    f"{micro} trains on any device count in [{low}, {high}]")
    batch = abs(best[1])
    return batch, _valid_counts(batch, micro, low, high)


def _world_from_environment(model_parallel: int) -> int:
    raw = os.environ.get("WORLD_SIZE", "")
    if not re.fullmatch(r"[0-9]+", raw) or int(raw) < 1 or int(raw) % model_parallel:
        raise ElasticityConfigError(f"a world size is needed: give world_size (data-parallel ranks) or set "
                                    f"WORLD_SIZE to a positive multiple of model_parallel_size {model_parallel} "
                                    f"(WORLD_SIZE is {raw or 'not set'!r})")
    return int(raw) // model_parallel


def _largest_micro(batch: int, world: int, micro: list[int]) -> int:
    return max(m for m in micro if (batch // world) % m == 0)


def _check_version(target: Any) -> None:
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", target) if isinstance(target, str) else None
    if match is None:
        raise ElasticityError(f"target_deepspeed_version must be a version string 'major.minor[.patch]', got "
                              f"{target!r}")
    if tuple(int(p or 0) for p in match.groups()) < (0, 3, 8):
        raise ElasticityError(f"target DeepSpeed version {target} is not compatible with elasticity, which needs "
                              f"{MINIMUM_DEEPSPEED_VERSION} or later")


def compute_elastic_config(ds_config: dict, target_deepspeed_version: str, world_size: int = 0,
                           return_microbatch: bool = False) -> tuple:
    """DeepSpeed's elastic batch size for ``ds_config``'s ``elasticity`` section (see the module docstring).

    Returns ``(final_batch_size, valid_gpus)``; with ``world_size > 0`` (the data-parallel ranks, as
    DeepSpeed's runtime passes it) ``(final_batch_size, valid_gpus, micro_batch_size)``, the largest
    micro-batch size that divides ``final_batch_size / world_size``, and the same triple with
    ``return_microbatch`` when the world size comes from ``WORLD_SIZE``. Version 0.2 with no
    ``world_size`` reads ``WORLD_SIZE`` (all ranks; divided by ``model_parallel_size``).

    Raises `ElasticityConfigError` (section missing, disabled, or a bad value), `ElasticityError`
    (``target_deepspeed_version`` older than 0.3.8) and `ElasticityIncompatibleWorldSize` (a world
    size outside ``valid_gpus``)."""
    if not isinstance(ds_config, dict):
        raise ElasticityConfigError(f"ds_config must be a dictionary, got {type(ds_config).__name__}")
    if "elasticity" not in ds_config:
        raise ElasticityConfigError("'elasticity' is missing from the config; add it to run an elastic job")
    section = _Section(ds_config["elasticity"])
    _check_version(target_deepspeed_version)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 0:
        raise ElasticityConfigError(f"world_size must be an integer >= 0 (0: not known), got {world_size!r}")
    micro = section.micro
    world = world_size
    if section.version == 0.1:
        batch, valid = _search_v01(micro, section.max_batch, section.min_gpus, section.max_gpus, section.prefer_larger)
        if world == 0 and return_microbatch:
            world = _world_from_environment(1)
    else:
        if world == 0:
            world = _world_from_environment(section.model_parallel)
        dp_per_node = section.gpus_per_node // section.model_parallel
        node_batch, nodes = _search_v01(micro, section.max_batch // dp_per_node,
                                        section.min_gpus // section.gpus_per_node,
                                        section.max_gpus // section.gpus_per_node, section.prefer_larger)
        batch, valid = node_batch * dp_per_node, [n * dp_per_node for n in nodes]
        if world not in valid:  # the best batch this world size alone can train with
            fits = [section.max_batch // (m * world) * m * world for m in micro]
            fits = [b for b in fits if b > 0]
            if not fits:
                raise ElasticityIncompatibleWorldSize(
                    f"world size {world} is not valid: no batch <= max_train_batch_size {section.max_batch} "
                    f"trains on {world} data-parallel ranks with micro_batch_sizes {micro}; valid: {valid}")
            batch, valid = (max(fits) if section.prefer_larger else min(fits)), [world]
    log.info("elasticity %s: train batch size %d, valid data-parallel world sizes %s", section.version, batch, valid)
    if world_size > 0 or return_microbatch:
        if world not in valid:
            raise ElasticityIncompatibleWorldSize(f"world size {world} is not valid with this elastic config; the "
                                                  f"valid data-parallel world sizes are {valid}")
        if world_size == 0 and section.version == 0.2:  # DeepSpeed's pick here: the first that divides, or largest
            fitting = [m for m in micro if (batch // world) % m == 0]
            return batch, valid, (max(fitting) if section.prefer_larger else fitting[0])
        return batch, valid, _largest_micro(batch, world, micro)
    return batch, valid


def elastic_rank_counts(ds_config: dict, target_deepspeed_version: str) -> tuple[int, list[int]]:
    """For an elastic launcher: ``(final_batch_size, rank_counts)``, the total numbers of ranks (data-parallel
    ranks × ``model_parallel_size``) that train with that one global batch size, ascending. Unlike
    `compute_elastic_config` with version 0.2 it needs no world size: the fallback batch 0.2 computes for a
    world size outside the list (another global batch) is not an elastic size."""
    if not isinstance(ds_config, dict):
        raise ElasticityConfigError(f"ds_config must be a dictionary, got {type(ds_config).__name__}")
    if "elasticity" not in ds_config:
        raise ElasticityConfigError("'elasticity' is missing from the config; add it to run an elastic job")
    section = _Section(ds_config["elasticity"])
    _check_version(target_deepspeed_version)
    if section.version == 0.1:
        batch, valid = _search_v01(section.micro, section.max_batch, section.min_gpus, section.max_gpus,
                                   section.prefer_larger)
        return batch, valid
    dp_per_node = section.gpus_per_node // section.model_parallel
    node_batch, nodes = _search_v01(section.micro, section.max_batch // dp_per_node,
                                    section.min_gpus // section.gpus_per_node,
                                    section.max_gpus // section.gpus_per_node, section.prefer_larger)
    return node_batch * dp_per_node, [n * dp_per_node * section.model_parallel for n in nodes]
