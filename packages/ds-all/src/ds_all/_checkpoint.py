"""The engine's checkpoints: ``save_checkpoint``/``load_checkpoint`` with DeepSpeed's names, tags and
``latest`` file, on top of ds-zero's sharded checkpoint (DCP), so a checkpoint loads on another world
size or ZeRO stage with no offline step.

A tag directory holds DCP's files (ZeRO's shards, each rank's random states, the client's tensors),
``zero_meta.json`` and ``engine_meta.json`` (counters, the schedule, the data loader's position, the
client's plain values). It is written under a temporary name (``.<tag>.partial``), every file fsynced,
then renamed into place; ``latest`` is replaced last, atomically. A save killed at any moment leaves
the previous tag loadable and ``latest`` naming it; a partial tag is never loaded. ``async_save=True``
copies what is written, returns, and writes in a background thread (the rename and ``latest`` there too,
once every rank's files are written); the next save, a load or `wait_checkpoint` waits for it.

A model with MoE layers (ds-moe) is checkpointed the same way: ZeRO names each expert parameter and
buffer by its global expert id (the engine's ``checkpoint_names``), so a checkpoint loads at another
``ep_size``; the layers' layout is recorded in ``engine_meta.json`` (``moe``) and a change of ``ep_size``
is logged at load.

A model with tensor-parallel layers (ds-parallel's, or any parameter with Megatron's marks
``tensor_model_parallel``/``partition_dim``) saves each slice as its part of the whole parameter
(ds-zero's ``_checkpoint_tp``, given the mpu's tensor-parallel group), so a checkpoint saved at one
tensor-parallel size loads at another, and into the unsplit model, weights and optimizer states alike.

A tag directory DeepSpeed wrote (no ``engine_meta.json``, DeepSpeed's ``*model_states.pt``) loads through
`_deepspeed_checkpoint`; with ``checkpoint.load_universal`` the default tag is what ``latest_universal`` names.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from ds_config import write_atomic

import ds_comm
import ds_ops
import ds_zero
from ds_zero import (
    is_deepspeed_checkpoint,
    load_zero_checkpoint,
    save_zero_checkpoint,
    write_recovery_scripts,
)

from ._deepspeed_checkpoint import LATEST_UNIVERSAL
from ._train_state import Restore, Stateful

logger = logging.getLogger("ds_all")

LATEST = "latest"
META_FILE = "engine_meta.json"
FORMAT = 1


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_tag(tag: Any) -> str:
    if not isinstance(tag, str) or not tag or tag in (".", "..") or "/" in tag or tag.startswith("."):
        raise ValueError(f"checkpoint tag must be a non-empty name without '/' that does not start with '.', got {tag!r}")
    return tag


def tensor_parallel_group(mpu: Any) -> Any:
    """The tensor-parallel group of an ``mpu`` (DeepSpeed's order of questions: Megatron's
    ``get_tensor_model_parallel_group``, then the pipeline grid's ``get_slice_parallel_group``, then
    ``get_model_parallel_group``); None without one."""
    if mpu is None:
        return None
    for question in ("get_tensor_model_parallel_group", "get_slice_parallel_group", "get_model_parallel_group"):
        if hasattr(mpu, question):
            return getattr(mpu, question)()
    return None


def check_directory(path: Any, call: str, name: str) -> None:
    """``path`` names a directory: a non-empty string or path (an empty one would mean the working
    directory, never what a caller meant)."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"{call}: {name} must be a directory (a non-empty str or os.PathLike), got {path!r}")


def _validate_tag_across_ranks(mode: str, world_size: int, tag: str) -> None:
    if mode == "Ignore" or world_size == 1:
        return
    tags: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(tags, tag)
    if len(set(tags)) > 1:
        message = f"checkpoint tags differ across ranks: {tags}"
        if mode == "Fail":
            raise ValueError(message + " (checkpoint.tag_validation is Fail)")
        logger.warning("%s (checkpoint.tag_validation is Warn)", message)


def _split_client_state(client_state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Plain values (saved as JSON) and tensors (saved with DCP); anything else is refused, so loading
    never unpickles an object."""
    if not isinstance(client_state, dict):
        raise ValueError(f"client_state must be a dict, got {type(client_state).__name__}")
    plain, tensors = {}, {}
    for key, value in client_state.items():
        if not isinstance(key, str) or "/" in key:
            raise ValueError(f"client_state keys must be strings without '/', got {key!r}")
        if torch.is_tensor(value):
            tensors[key] = value.detach().cpu()
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            raise ValueError(f"client_state[{key!r}] is a {type(value).__name__}: only JSON values (numbers, strings, "
                             "lists, dicts, None) and tensors are saved, so that loading executes nothing") from None
        plain[key] = value
    return plain, tensors


def _device_rng_key(rank: int) -> str | None:
    """The entry of this rank's device random state (``rng/<rank>/cuda``), or None on the CPU, whose
    state is ``rng/<rank>/cpu``."""
    name = ds_ops.get_accelerator().device_name()
    return None if name == "cpu" else f"rng/{rank}/{name}"


def _rng_states() -> dict[str, torch.Tensor]:
    """This rank's random states: the CPU generator's, and the accelerator's current device's (a CPU
    byte tensor, through the seam) when there is one."""
    rank = ds_comm.get_rank()
    states = {f"rng/{rank}/cpu": torch.get_rng_state()}
    key = _device_rng_key(rank)
    if key is not None:
        states[key] = ds_ops.get_accelerator().get_rng_state()
    return states


def _complete(root: Path, tag: str, meta: dict[str, Any], save_latest: bool) -> None:
    """Rank 0, once every rank's files are written: the engine's metadata, the rename into place,
    then ``latest``."""
    partial, final = root / f".{tag}.partial", root / tag
    write_atomic(partial / META_FILE, json.dumps(meta))
    _fsync_dir(partial)
    aside = root / f".{tag}.replaced"
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(partial, final)
    _fsync_dir(root)
    shutil.rmtree(aside, ignore_errors=True)
    if save_latest:
        write_atomic(root / LATEST, tag)
    write_recovery_scripts(root)  # zero_to_fp32.py and zero_to_torch.py, where DeepSpeed's save puts its own


class _PendingSave:
    """An asynchronous save: DCP's write in the background, then (rank 0) `_complete` in the same
    thread; `wait` gives its error, if any, to the caller."""

    def __init__(self, written: Future, then: Any) -> None:
        self.done, self.error = threading.Event(), None
        self._then = then
        written.add_done_callback(self._finish)

    def _finish(self, written: Future) -> None:
        try:
            written.result()
            self._then()
        except BaseException as e:  # handed to wait()
            self.error = e
        finally:
            self.done.set()

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise RuntimeError(f"save_checkpoint(async_save=True) failed in the background: {self.error}") \
                from self.error


class ScheduleState:
    """The learning-rate schedule (None: none) as a part of a checkpoint: its ``state_dict``, which must be plain
    data (the metadata is JSON)."""

    restore = Restore.SCHEDULE

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> Any:
        if self.scheduler is None or not hasattr(self.scheduler, "state_dict"):
            return None
        state = self.scheduler.state_dict()
        try:
            json.dumps(state)
        except (TypeError, ValueError):
            raise ValueError(f"save_checkpoint: the schedule's state ({type(self.scheduler).__name__}) holds values "
                             "that are not plain data; it cannot be saved safely") from None
        return state

    def load_state_dict(self, state: Any) -> None:
        if self.scheduler is not None and state is not None:
            self.scheduler.load_state_dict(state)

def _resolve_tag(root: Path, tag: str | None, universal: bool = False) -> str | None:
    if tag is not None:
        return _check_tag(tag)
    latest = root / LATEST
    if universal and (root / LATEST_UNIVERSAL).exists():  # checkpoint.load_universal: DeepSpeed's universal tag
        latest = root / LATEST_UNIVERSAL
    if not latest.exists():
        return None
    return _check_tag(latest.read_text().strip())


def _client_tensors(path: Path, keys: list[str], saved: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The client's tensors, read into CPU tensors (as they were saved: `_split_client_state`)."""
    out = {}
    for key in keys:
        md = saved.get(f"client/{key}")
        if md is None:
            raise ValueError(f"load_checkpoint: {path} lists client tensor {key!r} but does not hold it")
        out[key] = torch.empty(md.size, dtype=md.properties.dtype, device="cpu")
    return out


class Checkpointer:
    """The engine's ``save_checkpoint``/``load_checkpoint``/``wait_checkpoint`` over one ZeRO optimizer and a dict
    of `Stateful` parts (see the module docstring). ``states``: metadata key -> part, each part's ``state_dict()``
    written under its key (key ``""``: its keys at the top level, format 1's place of the counters) and restored
    when its ``restore`` says so. The asynchronous save in flight and its writer group are this object's."""

    def __init__(self, zero: Any, *, states: Mapping[str, Stateful], world_size: int, global_rank: int,
                 dp_world_size: int, zero_stage: int, mpu: Any, tag_validation: str, load_universal: bool) -> None:
        self.zero, self.states = zero, dict(states)
        self.world_size, self.global_rank, self.dp_world_size = world_size, global_rank, dp_world_size
        self.zero_stage, self.mpu = zero_stage, mpu
        self.tag_validation, self.load_universal = tag_validation, load_universal
        self.pending: _PendingSave | None = None  # an asynchronous save still writing
        self.writer_group: Any = None  # the process group of its background collectives

    def _writer(self) -> Any:
        """A gloo group of every rank for the background writer's collectives (training's own must not
        interleave with them); made once, by every rank at its first asynchronous save."""
        if self.writer_group is None:
            self.writer_group = torch.distributed.new_group(backend="gloo")
        return self.writer_group

    def close(self) -> None:
        """The writer group destroyed (after `wait`)."""
        if self.writer_group is not None:
            torch.distributed.destroy_process_group(self.writer_group)
            self.writer_group = None

    def metadata(self, tag: str, plain: dict[str, Any], tensors: list[str]) -> dict[str, Any]:
        """``engine_meta.json``: the run's shape, every part's state under its key, and the client's values."""
        meta: dict[str, Any] = {"format": FORMAT, "tag": tag, "world_size": self.world_size,
                                "dp_world_size": self.dp_world_size, "zero_stage": self.zero_stage}
        for key, part in self.states.items():
            if key:
                meta[key] = part.state_dict()
            else:
                meta.update(part.state_dict())
        return {**meta, "client_state": plain, "client_tensors": sorted(tensors)}

    def save(self, save_dir: Any, tag: str, client_state: dict | None, save_latest: bool,
             exclude_frozen_parameters: bool, async_save: bool) -> bool:
        check_directory(save_dir, "save_checkpoint", "save_dir")
        self.wait()  # one save at a time
        tag = _check_tag(tag)
        plain, tensors = _split_client_state(client_state or {})
        _validate_tag_across_ranks(self.tag_validation, self.world_size, tag)
        root = Path(save_dir)
        partial = root / f".{tag}.partial"
        if self.global_rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)  # a save interrupted earlier
            partial.mkdir()
        ds_comm.barrier()
        extra = {**_rng_states(), **{f"client/{k}": v for k, v in tensors.items()}}
        group = self._writer() if async_save else None
        written = save_zero_checkpoint(self.zero, partial, extra=extra,
                                       exclude_frozen_parameters=exclude_frozen_parameters, async_group=group,
                                       tensor_parallel_group=tensor_parallel_group(self.mpu))
        # what the run is at now (the write may finish steps later)
        meta = self.metadata(tag, plain, list(tensors)) if self.global_rank == 0 else None
        if written is not None:
            self.pending = _PendingSave(written, lambda: _complete(root, tag, meta, save_latest)
                                        if self.global_rank == 0 else None)
            return True
        ds_comm.barrier()  # every rank's shards are written and fsynced (DCP's sync_files)
        if self.global_rank == 0:
            _complete(root, tag, meta, save_latest)
        ds_comm.barrier()
        return True

    def wait(self) -> None:
        """Wait for the asynchronous save in flight, if any (every rank calls it): afterwards its tag is in
        place and ``latest`` names it. A failure in the background is raised here."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            pending.wait()
        finally:
            ds_comm.barrier()  # rank 0's rename is done before any rank goes on

    def load(self, load_dir: Any, tag: str | None, load_module_strict: bool, load_optimizer_states: bool,
             load_lr_scheduler_states: bool, load_module_only: bool,
             load_deepspeed: Callable[..., tuple[str, dict]]) -> tuple[str | None, dict | None]:
        """``load_deepspeed(path)``: how a tag directory DeepSpeed wrote is loaded (`_deepspeed_checkpoint`)."""
        self.wait()
        root = Path(load_dir)
        tag = _resolve_tag(root, tag, self.load_universal)
        if tag is None:
            logger.warning("load_checkpoint: %s has no '%s' file and no tag was given; nothing loaded", root, LATEST)
            return None, None
        path = root / tag
        if not (path / META_FILE).exists() and is_deepspeed_checkpoint(path):  # written by DeepSpeed itself
            return load_deepspeed(path)
        if not (path / META_FILE).exists():
            if (root / f".{tag}.partial").exists():
                raise FileNotFoundError(f"load_checkpoint: {path} was never completed (its save was interrupted: "
                                        f"{root / f'.{tag}.partial'}); load another tag")
            raise FileNotFoundError(f"load_checkpoint: {path} is not a checkpoint (no {META_FILE})")
        try:
            meta = json.loads((path / META_FILE).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"load_checkpoint: {path / META_FILE} is corrupt ({e})") from None
        if meta.get("format") != FORMAT:
            raise ValueError(f"load_checkpoint: {path} has format {meta.get('format')!r}; this ds-all reads {FORMAT}")
        rank = self.global_rank
        same_world = meta["world_size"] == self.world_size
        extra: dict[str, torch.Tensor] = {}
        rng = torch.get_rng_state()
        saved = ds_zero.SafeReader(str(path)).read_metadata().state_dict_metadata  # (loads DCP: on first use)
        device_key = _device_rng_key(rank)
        device_rng = ds_ops.get_accelerator().get_rng_state() \
            if same_world and device_key is not None and device_key in saved else None
        if same_world:  # each rank's own random state; on another world size the ranks' streams differ anyway
            extra[f"rng/{rank}/cpu"] = rng
            if device_rng is not None:  # saved on this kind of device (a CPU run's checkpoint has none)
                extra[device_key] = device_rng
        client_tensors = _client_tensors(path, meta["client_tensors"], saved)
        extra.update({f"client/{k}": v for k, v in client_tensors.items()})
        optimizer_too = load_optimizer_states and not load_module_only
        load_zero_checkpoint(self.zero, path, load_optimizer=optimizer_too, extra=extra, strict=load_module_strict,
                             tensor_parallel_group=tensor_parallel_group(self.mpu))
        if same_world:
            torch.set_rng_state(rng)
            if device_rng is not None:
                ds_ops.get_accelerator().set_rng_state(device_rng)
        for key, part in self.states.items():
            if part.restore.wanted(module_only=load_module_only, same_world=same_world,
                                   schedule=load_lr_scheduler_states):
                part.load_state_dict(meta.get(key) if key else meta)
        client_state = {**meta["client_state"], **client_tensors}
        return str(path), client_state
