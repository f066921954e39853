"""`PipelineModule`: a model given as a list of layers, cut into stages, each rank building only its own.

A layer is an ``nn.Module``, a `LayerSpec` (built only on the stage that owns it), a `TiedLayerSpec`
(one module per stage that holds the key, its weight shared between those stages), or a plain callable
(no parameters: a reshape, a lambda). The layers run in order, each given what the previous returned
(a tuple is passed as one argument, as DeepSpeed does).

With ``virtual_stages=v`` (interleaved schedules) the layers are cut into ``num_stages * v`` parts and
stage ``s`` owns parts ``s, s + p, s + 2p, ...``: chunk ``c`` of stage ``s`` is part ``c * p + s``.

A stage's layers are moved to the stage's device once built, as DeepSpeed's are: ``cuda:<LOCAL_RANK>``
with a GPU accelerator (ds-ops' seam), the CPU otherwise (`_device.stage_device`).
"""

from __future__ import annotations

import itertools
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import ds_comm

from ._device import stage_device
from ._grid import PipelineParallelGrid

logger = logging.getLogger(__name__)


class LayerSpec:
    """A layer to build later: ``LayerSpec(nn.Linear, 4, 8)`` builds ``nn.Linear(4, 8)`` on the stage
    that owns it, and nowhere else."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise ValueError(f"LayerSpec: typename must be an nn.Module subclass, got {typename!r}")
        self.typename, self.module_args, self.module_kwargs = typename, module_args, module_kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer whose ``tied_weight_attr`` is shared by every layer of the same ``key`` (an embedding and
    the LM head): one module per stage holding the key; its gradient is summed over those stages.
    ``forward_fn(module, inputs)``, if given, runs instead of ``module(inputs)`` (the head's use of the
    embedding's weight)."""

    def __init__(self, key: str, typename: type, *module_args: Any, forward_fn: Callable | None = None,
                 tied_weight_attr: str | Sequence[str] = "weight", **module_kwargs: Any):
        super().__init__(typename, *module_args, **module_kwargs)
        if not isinstance(key, str) or not key:
            raise ValueError(f"TiedLayerSpec: key must be a non-empty string, got {key!r}")
        if forward_fn is not None and not callable(forward_fn):
            raise ValueError(f"TiedLayerSpec {key!r}: forward_fn must be callable, got {forward_fn!r}")
        self.key, self.forward_fn = key, forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries ``[0, ..., num_items]`` of ``num_parts`` parts whose sizes differ by at most one
    (the larger ones first)."""
    base, extra = divmod(num_items, num_parts)
    bounds = [0]
    for part in range(num_parts):
        bounds.append(bounds[-1] + base + (1 if part < extra else 0))
    return bounds


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Boundaries of ``num_parts`` contiguous non-empty parts minimising the heaviest part (exact, by
    dynamic programming; ties go to the cut that puts more items early)."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the lightest heaviest part when the first i items form k parts
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0.0
    for k in range(1, num_parts + 1):
        for i in range(k, n - (num_parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i] or (cost == best[k][i] and j > cut[k][i]):
                    best[k][i], cut[k][i] = cost, j
    bounds = [n]
    for k in range(num_parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def _layer_name(layer: Any) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", type(layer).__name__)


def _count_params(layer: Any) -> int:
    """Trainable parameters of a layer; a spec is built on the meta device (no memory, no RNG)."""
    if isinstance(layer, LayerSpec):
        with torch.device("meta"):
            layer = layer.build()
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    return 0


class PipelineModule(nn.Module):
    """A model as a list of layers, partitioned over ``num_stages`` pipeline stages (DeepSpeed's
    arguments). Needs the process group: the topology is ``pipe × data`` (``num_stages`` stages,
    ``world_size // num_stages`` data-parallel replicas) unless ``topology`` is given.

    ``partition_method``: ``"parameters"`` (balance trainable parameter counts), ``"uniform"``
    (balance layer counts), ``"type:<regex>"`` (balance the layers whose class name matches), or a list
    of ``num_stages * virtual_stages + 1`` boundaries ``[0, ..., len(layers)]``. ``dynamic_shape``: the
    activations between stages may change shape from one micro-batch to the next (their shapes then
    travel with each message; otherwise a change is an error).
    """

    def __init__(self, layers: Sequence[Any], num_stages: int | None = None, topology=None,
                 loss_fn: Callable | None = None, seed_layers: bool = False, seed_fn: Callable | None = None,
                 base_seed: int = 1234, partition_method: str | Sequence[int] = "parameters",
                 activation_checkpoint_interval: int = 0, activation_checkpoint_func: Callable | None = None,
                 checkpointable_layers: Sequence[str] | None = None, dynamic_shape: bool = False,
                 virtual_stages: int = 1):
        super().__init__()
        layers = list(layers)
        if not layers:
            raise ValueError("PipelineModule: layers is empty; give at least one layer per stage")
        for i, layer in enumerate(layers):
            if not (isinstance(layer, (LayerSpec, nn.Module)) or callable(layer)):
                raise ValueError(f"PipelineModule: layer {i} is {layer!r}; a layer is an nn.Module, a LayerSpec, "
                                 "a TiedLayerSpec or a callable")
        if num_stages is None and topology is None:
            raise ValueError("PipelineModule: give num_stages or topology")
        if not isinstance(virtual_stages, int) or virtual_stages < 1:
            raise ValueError(f"PipelineModule: virtual_stages must be a positive integer, got {virtual_stages!r}")
        if not isinstance(activation_checkpoint_interval, int) or activation_checkpoint_interval < 0:
            raise ValueError("PipelineModule: activation_checkpoint_interval must be an integer >= 0, "
                             f"got {activation_checkpoint_interval!r}")
        if loss_fn is not None and not callable(loss_fn):
            raise ValueError(f"PipelineModule: loss_fn must be callable, got {loss_fn!r}")
        world = ds_comm.get_world_size()
        if topology is None:
            if not isinstance(num_stages, int) or num_stages < 1:
                raise ValueError(f"PipelineModule: num_stages must be a positive integer, got {num_stages!r}")
            if world % num_stages:
                raise ValueError(f"PipelineModule: num_stages={num_stages} does not divide the world size {world}")
            topology = ds_comm.ProcessTopology(["pipe", "data"], [num_stages, world // num_stages])
        elif "pipe" not in topology.axes:
            raise ValueError(f"PipelineModule: the topology needs a 'pipe' axis, got axes {topology.axes}")
        elif topology.world_size() != world:
            raise ValueError(f"PipelineModule: the topology has {topology.world_size()} ranks, the world {world}")
        stages = topology.get_dim("pipe")
        if num_stages is not None and num_stages != stages:
            raise ValueError(f"PipelineModule: num_stages={num_stages} but the topology has {stages} pipe stages")
        self.num_stages, self.virtual_stages = stages, virtual_stages
        self.loss_fn, self.seed_layers, self.base_seed = loss_fn, seed_layers, base_seed
        self.seed_fn = seed_fn or torch.manual_seed
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func or _checkpoint
        self.checkpointable_layers = checkpointable_layers
        self.dynamic_shape = bool(dynamic_shape)  # activations may change shape between micro-batches
        self._topology = topology
        self._grid = PipelineParallelGrid(topology)
        self.stage_id = self._grid.get_stage_id()
        self._layer_specs = layers
        self.parts = self._partition(layers, partition_method)
        if ds_comm.get_rank() == 0:
            logger.info("PipelineModule: %d layers over %d stages x %d chunks, boundaries %s", len(layers), stages,
                        virtual_stages, self.parts)
        self._build()
        self.to(stage_device())  # DeepSpeed's: the stage's layers on cuda:LOCAL_RANK with a GPU (a no-op on the CPU)
        self._tie_groups = self._make_tie_groups()
        # DeepSpeed's mark for gradient norms: a tied module counts once, on the first stage holding it
        for p in self.parameters():
            p.ds_pipe_replicated = False
        for key, (_, ranks) in self._tie_groups.items():
            if ds_comm.get_rank() != ranks[0]:
                for p in self.tied_modules[key].parameters():
                    p.ds_pipe_replicated = True
        self._synchronize_tied_weights()

    # -- partitioning ---------------------------------------------------------------------------
    def _partition(self, layers: list, method) -> list[int]:
        parts = self.num_stages * self.virtual_stages
        n = len(layers)
        if parts > n:
            raise ValueError(f"PipelineModule: {parts} stages (num_stages={self.num_stages} x "
                             f"virtual_stages={self.virtual_stages}) but only {n} layers; each stage needs a layer")
        if not isinstance(method, str):
            bounds = list(method)
            ok = (len(bounds) == parts + 1 and all(isinstance(b, int) for b in bounds) and bounds[0] == 0
                  and bounds[-1] == n and all(a < b for a, b in itertools.pairwise(bounds)))
            if not ok:
                raise ValueError(f"PipelineModule: partition_method {bounds} must be {parts + 1} strictly increasing "
                                 f"boundaries from 0 to {n} (the number of layers), one part per stage")
            return bounds
        lowered = method.lower()
        if lowered == "uniform":
            return partition_uniform(n, parts)
        if lowered == "parameters":
            return partition_balanced([_count_params(layer) for layer in layers], parts)
        if lowered.startswith("type:"):
            pattern = re.compile(method[5:], re.IGNORECASE)
            weights = [1 if pattern.search(_layer_name(layer)) else 0 for layer in layers]
            if not any(weights):
                names = sorted({_layer_name(layer) for layer in layers})
                raise ValueError(f"PipelineModule: partition_method {method!r} matches no layer; layer types: {names}")
            return partition_balanced(weights, parts)
        raise ValueError(f"PipelineModule: partition_method must be 'parameters', 'uniform', 'type:<regex>' or a "
                         f"list of boundaries, got {method!r}")

    def part_of(self, stage_id: int, chunk: int = 0) -> int:
        return chunk * self.num_stages + stage_id

    def stage_owner(self, layer_idx: int) -> int:
        """The stage that holds layer ``layer_idx``."""
        if not 0 <= layer_idx < len(self._layer_specs):
            raise ValueError(f"PipelineModule.stage_owner: layer {layer_idx} is outside 0..{len(self._layer_specs) - 1}")
        part = max(p for p in range(len(self.parts) - 1) if self.parts[p] <= layer_idx)
        return part % self.num_stages

    # -- building -------------------------------------------------------------------------------
    def _build(self) -> None:
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self._chunks: list[list[tuple[int, Callable]]] = []  # per chunk: (layer index, callable)
        for chunk in range(self.virtual_stages):
            part = self.part_of(self.stage_id, chunk)
            funcs = []
            for idx in range(self.parts[part], self.parts[part + 1]):
                funcs.append((idx, self._build_layer(idx, self._layer_specs[idx])))
            self._chunks.append(funcs)

    def _build_layer(self, idx: int, layer) -> Callable:
        if self.seed_layers:
            self.seed_fn(self.base_seed + idx)
        if isinstance(layer, TiedLayerSpec):
            if layer.key not in self.tied_modules:
                self.tied_modules[layer.key] = layer.build()
                self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
            module = self.tied_modules[layer.key]
            if layer.forward_fn is None:
                return module
            forward_fn = layer.forward_fn
            return lambda inputs, module=module: forward_fn(module, inputs)
        if isinstance(layer, LayerSpec):
            module = layer.build()
            self.add_module(str(idx), module)
            return module
        if isinstance(layer, nn.Module):
            self.add_module(str(idx), layer)
        return layer

    def _tied_keys(self) -> dict[str, list[int]]:
        """Every tie key of the model and the stages holding it (the same on every rank)."""
        keys: dict[str, list[int]] = {}
        for idx, layer in enumerate(self._layer_specs):
            if isinstance(layer, TiedLayerSpec):
                stage = self.stage_owner(idx)
                if stage not in keys.setdefault(layer.key, []):
                    keys[layer.key].append(stage)
        return keys

    def _make_tie_groups(self) -> dict[str, tuple[Any, list[int]]]:
        """One group per tie key and data-parallel line: the ranks of the stages holding the key. Every
        rank creates every group in the same order, as torch.distributed requires."""
        groups = {}
        topo = self._topology
        others = [a for a in topo.axes if a != "pipe"]
        for key, stages in sorted(self._tied_keys().items()):
            if len(stages) < 2:
                continue
            for coord in itertools.product(*(range(topo.get_dim(a)) for a in others)):
                ranks = sorted(topo.get_rank(pipe=s, **dict(zip(others, coord, strict=False))) for s in stages)
                group = ds_comm.new_group(ranks)
                if ds_comm.get_rank() in ranks:
                    groups[key] = (group, ranks)
        return groups

    def _synchronize_tied_weights(self) -> None:
        """Tied weights start equal on every stage: the lowest stage's values are broadcast."""
        for key, (group, ranks) in self._tie_groups.items():
            for attr in self.tied_weight_attrs[key]:
                ds_comm.broadcast(_attr(self.tied_modules[key], attr).data, src=ranks[0], group=group)

    def allreduce_tied_weight_gradients(self) -> None:
        """Sum each tied weight's gradient over the stages that hold it."""
        for key, (group, _) in self._tie_groups.items():
            for attr in self.tied_weight_attrs[key]:
                weight = _attr(self.tied_modules[key], attr)
                if weight.grad is None:
                    weight.grad = torch.zeros_like(weight)
                ds_comm.all_reduce(weight.grad, group=group)

    def checkpoint_names(self) -> dict[str, str]:
        """Names for checkpoints where a parameter's own would mean another tensor on another stage.
        Layers are named by their index in the whole model, so a checkpoint maps onto any stage count;
        a tied module's tied attributes are one tensor on every stage holding it, but its other
        parameters are separate copies: beyond the stage holding the key's first layer they are named
        after this stage's first layer of the key, ``tied_modules.<key>[<layer>].<name>``."""
        out = {}
        for key, module in self.tied_modules.items():
            layers = [idx for idx, spec in enumerate(self._layer_specs)
                      if isinstance(spec, TiedLayerSpec) and spec.key == key]
            mine = min(idx for chunk in self._chunks for idx, _ in chunk if idx in layers)
            if mine == layers[0]:
                continue
            tied = set(self.tied_weight_attrs[key])
            out.update({f"tied_modules.{key}.{name}": f"tied_modules.{key}[{mine}].{name}"
                        for name, _ in module.named_parameters() if name not in tied})
        return out

    def get_tied_weights_and_groups(self) -> list[tuple[torch.Tensor, Any]]:
        return [(_attr(self.tied_modules[key], attr), group) for key, (group, _) in self._tie_groups.items()
                for attr in self.tied_weight_attrs[key]]

    # -- running --------------------------------------------------------------------------------
    def forward(self, forward_input, chunk: int = 0):
        """Run this stage's layers of ``chunk`` (in groups of ``activation_checkpoint_interval`` through
        the checkpoint function when it is set and the module is training)."""
        if not 0 <= chunk < self.virtual_stages:
            raise ValueError(f"PipelineModule.forward: chunk {chunk} is outside 0..{self.virtual_stages - 1}")
        funcs = self._chunks[chunk]
        interval = self.activation_checkpoint_interval
        x = forward_input
        if interval == 0 or not self.training or not torch.is_grad_enabled():
            for _, func in funcs:
                x = func(x)
            return x
        for start in range(0, len(funcs), interval):
            group = funcs[start:start + interval]
            if self._is_checkpointable(group):
                x = self.activation_checkpoint_func(_run_range(group), *(x if isinstance(x, tuple) else (x,)))
            else:
                x = _run_range(group)(*(x if isinstance(x, tuple) else (x,)))
        return x

    def _is_checkpointable(self, group) -> bool:
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for _, f in group)
        return any(isinstance(f, nn.Module) and any(True for _ in f.parameters()) for _, f in group)

    def topology(self):
        return self._topology

    def mpu(self) -> PipelineParallelGrid:
        """The topology's groups and DeepSpeed's mpu questions (`PipelineParallelGrid`): what ds-all's
        engine takes as its mpu."""
        return self._grid

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def chunk_layers(self, chunk: int = 0) -> list[int]:
        """The layer indices this stage runs for ``chunk``."""
        return [idx for idx, _ in self._chunks[chunk]]


def _run_range(group):
    def run(*inputs):
        x = inputs[0] if len(inputs) == 1 else inputs
        for _, func in group:
            x = func(x)
        return x
    return run


def _checkpoint(function, *args):
    from torch.utils.checkpoint import checkpoint
    return checkpoint(function, *args, use_reentrant=False)


def _attr(module: nn.Module, dotted: str) -> torch.Tensor:
    for name in dotted.split("."):
        module = getattr(module, name)
    return module

