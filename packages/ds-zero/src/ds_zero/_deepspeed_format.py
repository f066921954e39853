"""DeepSpeed's own checkpoints, read into ds-zero: what a user switching from DeepSpeed brings along.

A DeepSpeed 0.19 tag directory holds ``mp_rank_00_model_states.pt`` (stages 0-2; the module's state dict,
the schedule, the counters, the client's state) or one ``zero_pp_rank_<r>_mp_rank_00_model_states.pt``
per rank (stage 3), and one ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per data-parallel
rank: each rank's flat float32 partition of every parameter group and its optimizer's states of the
same layout (stages 1-2: the group's parameters one after another, split evenly over the ranks;
stage 3: every parameter split on its own, padded to a multiple of the ranks). DeepSpeed's
``ds_to_universal`` writes ``zero/<parameter>/{fp32,exp_avg,exp_avg_sq,step}.pt`` instead. Either is
reassembled here into whole tensors per parameter and served to ``torch.distributed.checkpoint`` by a
`StorageReader` under ds-zero's own keys (``master/<name>``, ``optim/<key>/<name>``,
``optim_scalar/step``, ``module/<name>``), so `load_zero_state` loads it into any world size and stage as
it loads ds-zero's own checkpoints. Every rank reads the whole of the DeepSpeed files (the float32
weights and states of the model, for the time of the load).

The files are read with ``torch.load(weights_only=True)``. Besides tensors and plain data, DeepSpeed
pickles a few of its own objects: its loss scalers, the ZeRO stage enum and the fragment addresses of
``param_slice_mappings``; they are rebuilt as inert stand-ins (`DeepSpeedObject`: the arguments and
attributes they were pickled with, nothing executed), and ``argparse.Namespace`` (a client's args) as
itself. A file that asks for any other global is refused with a ValueError naming it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from ._policy import sharding

logger = logging.getLogger(__name__)


class DeepSpeedObject:
    """A DeepSpeed object found in a checkpoint, as data: ``args`` (what it was called with: an enum's
    value) and ``state`` (its pickled attributes). Nothing of DeepSpeed's is imported or run."""

    qualname = ""

    def __init__(self, *args: Any) -> None:
        self.args = args
        self.state: dict[str, Any] = {}

    def __setstate__(self, state: Any) -> None:
        self.args = getattr(self, "args", ())
        self.state = dict(state) if isinstance(state, dict) else {"state": state}

    def __repr__(self) -> str:
        return f"<DeepSpeed {self.qualname} {self.args or self.state}>"


_DEEPSPEED_CLASSES = ("deepspeed.runtime.fp16.loss_scaler.LossScaler",
                      "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                      "deepspeed.runtime.zero.config.ZeroStageEnum",
                      "deepspeed.runtime.zero.offload_config.OffloadDeviceEnum",
                      "deepspeed.utils.tensor_fragment.fragment_address")
_STAND_INS = [(type(name.rsplit(".", 1)[1], (DeepSpeedObject,), {"qualname": name}), name)
              for name in _DEEPSPEED_CLASSES] + [(argparse.Namespace, "argparse.Namespace")]
ALLOWED_GLOBALS = frozenset(name for _, name in _STAND_INS)


def load_file(path: Any) -> Any:
    """One DeepSpeed checkpoint file, read with ``weights_only=True`` and DeepSpeed's objects as stand-ins;
    a file that needs any other global raises a ValueError naming it."""
    path = str(path)
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except (RuntimeError, pickle.UnpicklingError, OSError) as e:
        raise ValueError(f"{path}: not a torch.save file ({e})") from None
    refused = sorted(set(unsafe) - ALLOWED_GLOBALS)
    if refused:
        raise ValueError(f"{path}: refusing to load: it pickles {', '.join(refused)}; a DeepSpeed checkpoint is read "
                         f"with weights_only=True, which allows tensors, plain data and {sorted(ALLOWED_GLOBALS)}")
    with torch.serialization.safe_globals(_STAND_INS):
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise ValueError(f"{path}: refusing to load: {e}") from None


_MODEL_FILE = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt")
_OPTIM_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")


def is_deepspeed_checkpoint(path: Any) -> bool:
    """Whether ``path`` is a DeepSpeed tag directory (its model-states files, or a universal checkpoint)."""
    path = Path(path)
    if not path.is_dir():
        return False
    return (path / "zero" / "optimizer_state.pt").exists() or \
        any(_MODEL_FILE.fullmatch(p.name) for p in path.iterdir())


def deepspeed_tag_dir(checkpoint_dir: Any, tag: str | None = None, latest: str = "latest") -> Path | None:
    """The DeepSpeed tag directory ``checkpoint_dir`` names (itself, ``tag`` in it, or what its ``latest``
    file names), or None when it is no DeepSpeed checkpoint."""
    root = Path(checkpoint_dir)
    if tag is None and is_deepspeed_checkpoint(root):
        return root
    if tag is None:
        if not (root / latest).is_file():
            return None
        tag = (root / latest).read_text().strip()
    return root / tag if is_deepspeed_checkpoint(root / tag) else None


def _refuse_unsupported(path: Path, names: list[str]) -> None:
    """Tensor-parallel, pipeline, expert (MoE) and ZeRO-Infinity checkpoints are refused, naming why."""
    if "offloaded_tensors" in names:
        raise NotImplementedError(f"{path}: a DeepSpeed ZeRO-Infinity checkpoint (offloaded_tensors/): its optimizer "
                                  "states are in DeepSpeed's NVMe swap files, which ds does not read")
    mp = {int(m[2]) for n in names if (m := _MODEL_FILE.fullmatch(n) or _OPTIM_FILE.fullmatch(n))}
    if len(mp) > 1 or mp - {0}:
        raise NotImplementedError(f"{path}: a tensor-parallel DeepSpeed checkpoint (mp ranks {sorted(mp)}): ds reads "
                                  "data-parallel ZeRO checkpoints only; merge the tensor-parallel slices first")
    if any("_expert_" in n or n.startswith("expp_rank_") or "_expp_rank_" in n for n in names):
        raise NotImplementedError(f"{path}: a DeepSpeed MoE checkpoint (expert files): ds does not read them")
    if any(n.startswith("layer_") for n in names):
        raise NotImplementedError(f"{path}: a pipeline-parallel DeepSpeed checkpoint (layer_*-model_states.pt): ds "
                                  "reads data-parallel ZeRO checkpoints only")


@dataclasses.dataclass
class DeepSpeedState:
    """A DeepSpeed checkpoint as whole tensors per parameter (flattened)."""
    stage: int
    world_size: int  # DeepSpeed's data-parallel ranks
    names: list[str]  # the trainable parameters, in DeepSpeed's order
    shapes: dict[str, list[int]]
    master: dict[str, torch.Tensor]  # float32 (16-bit where only the module's weights exist: stage 0)
    states: dict[str, dict[str, torch.Tensor]]  # optimizer state key -> name -> tensor
    scalars: dict[str, torch.Tensor]  # step
    module: dict[str, torch.Tensor]  # buffers and frozen parameters
    buffer_names: list[str]
    frozen_names: list[str]
    shared: dict[str, str]  # a tied parameter's other name -> the name it is saved under
    param_groups: list[dict[str, Any]]  # hyperparameters
    loss_scaler: dict[str, Any] | None  # DeepSpeed's attributes
    model_states: dict[str, Any]  # the (first) model-states file, without the module's tensors

    def entries(self) -> dict[str, torch.Tensor]:
        """ds-zero's checkpoint keys."""
        out = {f"master/{n}": t for n, t in self.master.items()}
        out.update({f"optim/{key}/{n}": t for key, by_name in self.states.items() for n, t in by_name.items()})
        out.update({f"optim_scalar/{key}": t for key, t in self.scalars.items()})
        out.update({f"module/{n}": t for n, t in self.module.items()})
        return out


def _stage(value: Any) -> int:
    if isinstance(value, DeepSpeedObject):
        value = value.args[0] if value.args else value.state.get("_value_")
    return int(value)


def _hyperparameters(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def _split_states(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sized = {k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0}
    return sized, {k: v for k, v in state.items() if k not in sized}


def _scalars(found: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in (found[0] if found else {}).items():
        out[key] = value.detach().clone().float() if torch.is_tensor(value) else torch.tensor(float(value))
    return out


def _flat_layout(shapes: dict[str, Any], paddings: list[int] | None) -> list[tuple[str, list[int], int]]:
    """(name, shape, offset) of each parameter of a stage-1/2 group flattened one after another."""
    out, offset = [], 0
    for i, (name, shape) in enumerate(shapes.items()):
        out.append((name, list(shape), offset))
        offset += math.prod(shape) + (paddings[i] if paddings else 0)
    return out


def _stage12(files: list[dict[str, Any]], shapes: list[dict[str, Any]], out: DeepSpeedState) -> None:
    first = files[0]
    paddings = first.get("param_alignment_paddings")
    steps = []
    for g, group_shapes in enumerate(shapes):
        flat = torch.cat([f["single_partition_of_fp32_groups"][g].float() for f in files])
        base = [f["base_optimizer_state"] for f in files]
        if isinstance(base[0], list):  # DeepSpeed's elastic_checkpoint: one state per group, without padding
            parts = [b[g] for b in base]
            steps += [{"step": f["base_optimizer_state_step"]} for f in files if "base_optimizer_state_step" in f]
        else:
            parts = [b["state"].get(g, {}) for b in base]
        sized = [_split_states(p) for p in parts]
        steps += [s[1] for s in sized if s[1]]
        keys = sorted(sized[0][0]) if sized else []
        states = {key: torch.cat([s[0][key].reshape(-1).float() for s in sized]) for key in keys}
        for name, shape, offset in _flat_layout(group_shapes, paddings[g] if paddings else None):
            n = math.prod(shape)
            out.master[name] = flat[offset:offset + n].clone()
            for key, values in states.items():
                out.states.setdefault(key, {})[name] = values[offset:offset + n].clone()
    out.scalars = _scalars(steps)
    groups = first["base_optimizer_state"]
    out.param_groups = _hyperparameters(groups["param_groups"]) if isinstance(groups, dict) else []


def _zero3_partition(numel: int, world_size: int) -> int:
    return math.ceil(numel / world_size)


def _stage3(files: list[dict[str, Any]], shapes: list[dict[str, Any]], out: DeepSpeedState) -> None:
    world = len(files)
    flats = [torch.cat([t.reshape(-1).float() for t in f["fp32_flat_groups"]]) for f in files]
    inner = [f.get("optimizer_state_dict", {}) for f in files]
    per_rank = []
    steps = []
    for state_dict in inner:
        subgroups = [state_dict["state"][i] for i in sorted(state_dict.get("state", {}))]
        sized = [_split_states(s) for s in subgroups]
        steps += [s[1] for s in sized if s[1]]
        keys = sorted(sized[0][0]) if sized else []
        per_rank.append({key: torch.cat([s[0][key].reshape(-1).float() for s in sized]) for key in keys})
    offset = 0
    for name, shape in ((n, list(s)) for group in shapes for n, s in group.items()):
        numel = math.prod(shape)
        part = _zero3_partition(numel, world)
        out.master[name] = torch.cat([f[offset:offset + part] for f in flats])[:numel].clone()
        for key in per_rank[0] if per_rank else {}:
            whole = torch.cat([r[key][offset:offset + part] for r in per_rank])[:numel]
            out.states.setdefault(key, {})[name] = whole.clone()
        offset += part
    out.scalars = _scalars(steps)
    out.param_groups = _hyperparameters(inner[0]["param_groups"]) if inner and "param_groups" in inner[0] else []


def _stage0(model_states: dict[str, Any], module: dict[str, torch.Tensor], out: DeepSpeedState) -> None:
    """No ZeRO: the module's weights (float32, or the 16-bit ones of a bf16 run) and torch's optimizer
    state dict, whose indices follow the module's parameters; with fp16, DeepSpeed's FP16_Optimizer
    (``fp32_groups_flat``: one flat float32 copy per group) or FP16_UnfusedOptimizer (``fp32_groups``: one
    per parameter) around it, and the loss scaler's attributes."""
    optimizer = model_states.get("optimizer")
    skip = set(out.buffer_names) | set(out.frozen_names)
    out.names = [n for n in module if n not in skip]
    out.shapes = {n: list(module[n].shape) for n in out.names}
    out.master = {n: module[n].reshape(-1).float().clone() for n in out.names}
    if not isinstance(optimizer, dict):
        return
    fp16 = "optimizer_state_dict" in optimizer
    inner = optimizer["optimizer_state_dict"] if fp16 else optimizer
    if fp16:
        out.loss_scaler = {"dynamic": bool(optimizer.get("dynamic_loss_scale")), "cur_scale": optimizer["cur_scale"],
                           "cur_iter": optimizer.get("cur_iter", 0),
                           "last_overflow_iter": optimizer.get("last_overflow_iter", -1)}
    copies = [t for group in optimizer.get("fp32_groups", []) for t in group]
    flats = optimizer.get("fp32_groups_flat")
    count = len(copies) if "fp32_groups" in optimizer else         sum(len(g["params"]) for g in inner["param_groups"]) if flats is None else None
    if count is not None and count != len(out.names):
        raise NotImplementedError(f"a DeepSpeed checkpoint without ZeRO whose optimizer holds {count} of the "
                                  f"module's {len(out.names)} parameters (frozen ones?): its states cannot be matched "
                                  "to names")
    if flats is not None:  # FP16_Optimizer: each group one flat tensor, its parameters one after another
        names, steps = iter(out.names), []
        for g, flat in enumerate(flats):
            sized, scalars = _split_states(inner["state"].get(g, {}))
            steps += [scalars] if scalars else []
            offset = 0
            while offset < flat.numel():
                name = next(names)
                n = math.prod(out.shapes[name])
                out.master[name] = flat[offset:offset + n].float().clone()
                for key, value in sized.items():
                    out.states.setdefault(key, {})[name] = value[offset:offset + n].float().clone()
                offset += n
    else:
        indices = [i for g in inner["param_groups"] for i in g["params"]]
        steps = []
        for position, (name, index) in enumerate(zip(out.names, indices, strict=True)):
            if copies:
                out.master[name] = copies[position].reshape(-1).float().clone()
            sized, scalars = _split_states(inner["state"].get(index, {}))
            steps += [scalars] if scalars else []
            for key, value in sized.items():
                out.states.setdefault(key, {})[name] = value.reshape(-1).float().clone()
    out.scalars = _scalars(steps)
    out.param_groups = _hyperparameters(inner["param_groups"])


def _universal(path: Path, shapes: list[dict[str, Any]], out: DeepSpeedState) -> None:
    common = load_file(path / "zero" / "optimizer_state.pt")
    steps = []
    for name, shape in ((n, list(s)) for group in shapes for n, s in group.items()):
        folder = path / "zero" / name
        if not (folder / "fp32.pt").exists():
            raise ValueError(f"{path}: universal checkpoint without {folder / 'fp32.pt'}")
        for item in sorted(folder.glob("*.pt")):
            value = load_file(item)
            value = value["param"] if isinstance(value, dict) else value
            if item.stem == "step" or value.dim() == 0:
                steps.append({item.stem: value})
                continue
            if value.numel() != math.prod(shape):
                raise ValueError(f"{item}: {list(value.shape)}, the model states say {shape} (a tensor-parallel "
                                 "slice or vocabulary padding, which ds does not read)")
            target = out.master if item.stem == "fp32" else out.states.setdefault(item.stem, {})
            target[name] = value.detach().reshape(-1).float().clone()
    out.scalars = _scalars(steps)
    out.param_groups = _hyperparameters(common.get("param_groups", []))
    out.loss_scaler = _scaler_state(common.get("loss_scaler"))


def _scaler_state(scaler: Any) -> dict[str, Any] | None:
    if isinstance(scaler, DeepSpeedObject):
        return dict(scaler.state)
    return None


def _module_tensors(model_files: list[dict[str, Any]], out: DeepSpeedState) -> dict[str, torch.Tensor]:
    """Buffers and frozen parameters; at stage 3 a frozen parameter is every rank's fragment."""
    first = model_files[0]
    module = first["module"]
    out.buffer_names = list(first.get("buffer_names") or [])
    frozen_shapes = first.get("frozen_param_shapes") or {}
    out.frozen_names = list(frozen_shapes)
    out.shared = dict(first.get("shared_params") or {})
    buffers = set(out.buffer_names)
    tensors = {n: t for n, t in module.items() if n in buffers}  # in the module's order
    fragments = first.get("frozen_param_fragments") or {}
    for name, shape in frozen_shapes.items():
        numel = math.prod(shape)
        if name in fragments and len(model_files) > 1 and sharding(out.stage).params:
            whole = torch.cat([f["frozen_param_fragments"][name].reshape(-1) for f in model_files])
            tensors[name] = whole[:numel].reshape(list(shape)).clone()
        elif name in fragments and fragments[name].numel() == numel:
            tensors[name] = fragments[name].reshape(list(shape))
        elif name in module and module[name].numel() == numel:
            tensors[name] = module[name]
    if not sharding(out.stage).params and first.get("param_shapes") is not None:  # frozen ones not listed (stage 1): the rest
        trainable = {n for g in first["param_shapes"] for n in g}
        for name, tensor in module.items():
            if name not in trainable and name not in tensors and name not in out.shared:
                tensors[name] = tensor
                out.frozen_names.append(name)
    return tensors


def read_deepspeed_checkpoint(path: Any) -> DeepSpeedState:
    """A DeepSpeed tag directory (stages 0-3, any precision) or universal checkpoint as whole tensors."""
    path = Path(path)
    names = sorted(p.name for p in path.iterdir())
    _refuse_unsupported(path, names)
    universal = (path / "zero" / "optimizer_state.pt").exists()
    model_names = sorted((n for n in names if _MODEL_FILE.fullmatch(n)),
                         key=lambda n: int(_MODEL_FILE.fullmatch(n)[1] or 0))
    if not model_names:
        raise ValueError(f"{path}: not a DeepSpeed checkpoint (no *model_states.pt)")
    model_files = [load_file(path / n) for n in model_names]
    first = model_files[0]
    optim_names = sorted((n for n in names if _OPTIM_FILE.fullmatch(n)),
                         key=lambda n: int(_OPTIM_FILE.fullmatch(n)[1]))
    shapes = first.get("param_shapes")
    out = DeepSpeedState(stage=0, world_size=int(first.get("dp_world_size") or 1), names=[], shapes={}, master={},
                         states={}, scalars={}, module={}, buffer_names=[], frozen_names=[], shared={}, param_groups=[],
                         loss_scaler=None, model_states={k: v for k, v in first.items() if k != "module"})
    if universal:
        out.stage = _stage(load_file(path / "zero" / "optimizer_state.pt").get("zero_stage", 0))
        out.module = _module_tensors(model_files, out)
        _universal(path, shapes, out)
    elif optim_names and shapes is not None:
        optim = [load_file(path / n)["optimizer_state_dict"] for n in optim_names]
        counts = optim[0].get("partition_count")
        world = max(counts) if isinstance(counts, list) else int(counts or len(optim))
        if world != len(optim):
            raise ValueError(f"{path}: {len(optim)} optimizer-states files for {world} ranks (a save that did not "
                             "complete, or files of another run mixed in)")
        out.world_size = world
        out.stage = _stage(optim[0]["zero_stage"]) if "zero_stage" in optim[0] else \
            (3 if "fp32_flat_groups" in optim[0] else 1)  # BF16_Optimizer's files name no stage
        out.module = _module_tensors(model_files, out)
        if sharding(out.stage).params:
            _stage3(optim, shapes, out)
        else:
            _stage12(optim, shapes, out)
        out.loss_scaler = _scaler_state(optim[0].get("loss_scaler"))
    elif shapes is None:
        out.module = _module_tensors(model_files, out)
        _stage0(first, first["module"], out)
    else:
        raise ValueError(f"{path}: a DeepSpeed ZeRO checkpoint without its *_optim_states.pt files")
    if shapes is not None:
        out.names = [n for group in shapes for n in group]
        out.shapes = {n: list(s) for group in shapes for n, s in group.items()}
    missing = [n for n in out.names if n not in out.master]
    if missing:
        raise ValueError(f"{path}: no float32 weights for {missing}")
    return out


def fp32_state_dict(path: Any, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
    """What DeepSpeed's ``zero_to_fp32`` makes of a DeepSpeed tag directory: the buffers (floating ones in
    float32), the frozen parameters, the float32 weights, then a tied parameter's other names. It also
    reads what DeepSpeed's refuses: stage 1 bf16 (BF16_Optimizer's files), stage 0 (the module's
    weights in float32) and universal checkpoints."""
    from collections import OrderedDict

    state = read_deepspeed_checkpoint(path)
    out: dict[str, torch.Tensor] = OrderedDict()
    for name in state.buffer_names:
        if name in state.module:
            t = state.module[name]
            out[name] = t.float() if t.is_floating_point() else t
    for name in [] if exclude_frozen_parameters else state.frozen_names:
        out[name] = state.module[name]
    for name in state.names:
        out[name] = state.master[name].view(state.shapes[name])
    for alias, source in state.shared.items():
        if source in out:
            out[alias] = out[source]
    return out


def _scaler_for(zero: Any, saved: dict[str, Any] | None) -> dict[str, Any] | None:
    """DeepSpeed's dynamic loss scaler in ds-zero's terms (for a fp16 run that scales dynamically)."""
    if zero.scaler is None or not saved or not saved.get("dynamic") or not zero.scaler.dynamic:
        return None
    return {"scale": float(saved["cur_scale"]), "step": int(saved.get("cur_iter", 0)),
            "last_overflow_step": int(saved.get("last_overflow_iter", -1)),
            "hysteresis_left": int(saved.get("cur_hysteresis", zero.scaler.hysteresis))}


def load_deepspeed_checkpoint(zero: Any, path: Any, *, load_optimizer: bool = True, strict: bool = True) -> dict[str, Any]:
    """Load the DeepSpeed tag directory (or universal checkpoint) ``path`` into ``zero`` on any world size
    and stage (every rank calls it; each reads the DeepSpeed files). Returns DeepSpeed's model states
    without the module's tensors (the schedule, counters, the client's entries)."""
    # _deepspeed_reader imports torch.distributed.checkpoint (seconds): here, not with ds_zero
    from ._checkpoint import FORMAT, load_zero_state
    from ._deepspeed_reader import DeepSpeedReader

    state = read_deepspeed_checkpoint(path)
    if not load_optimizer:
        state.states, state.scalars = {}, {}
    groups = zero.optimizer.param_groups
    saved_groups = state.param_groups
    if saved_groups and len(saved_groups) != len(groups):
        logger.warning("load_deepspeed_checkpoint: %s has %d parameter groups, this optimizer %d: the "
                       "hyperparameters are the configured ones", path, len(saved_groups), len(groups))
        saved_groups = []
    steps = int(state.model_states.get("global_steps") or 0)
    meta = {"format": FORMAT, "zero_stage": state.stage, "world_size": state.world_size, "precision": None,
            "optimizer": "DeepSpeed", "names": state.names, "shapes": [state.shapes[n] for n in state.names],
            "param_groups": [{k: v for k, v in saved.items() if k in group}
                             for group, saved in zip(groups, saved_groups, strict=False)],  # none when they differ
            "excluded_frozen": [], "micro_step": steps * zero.gradient_accumulation_steps,
            "skipped_steps": int(state.model_states.get("skipped_steps") or 0),
            "loss_scaler": _scaler_for(zero, state.loss_scaler)}
    load_zero_state(zero, DeepSpeedReader(state), meta, load_optimizer=load_optimizer, strict=strict)
    logger.info("loaded DeepSpeed's checkpoint %s (ZeRO stage %d, %d ranks)", path, state.stage, state.world_size)
    return state.model_states
