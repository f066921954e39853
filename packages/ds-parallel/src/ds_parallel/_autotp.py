"""AutoTP: ``tp_model_init`` slices a Hugging Face model's attention and MLP linears across a tensor-parallel
group by recognising their names, and `replace_module_consolidated_state_dict` gathers the full weights back
for save/export.

What is recognised, inside each layer of the model's layer list (the children of its top-level
``nn.ModuleList``s, where DeepSpeed's AutoTP looks):

==========================================  ===========================  ==============================
module (its children)                       column (`LinearLayer`)       row (`LinearAllreduce`)
==========================================  ===========================  ==============================
attention: ``q_proj k_proj v_proj``         ``q_proj k_proj v_proj``     ``o_proj`` / ``out_proj``
+ ``o_proj`` / ``out_proj`` (Llama family)
GPT-2 attention: ``c_attn c_proj``          ``c_attn`` per head: each    ``c_proj``
(``Conv1D``)                                rank its heads of q, k, v
MLP: ``up_proj`` [``gate_proj``]            ``up_proj gate_proj``        ``down_proj``
+ ``down_proj``
GPT-2 MLP: ``c_fc c_proj`` (``Conv1D``)     ``c_fc``                     ``c_proj``
==========================================  ===========================  ==============================

The heads are divided across ranks (query and key/value heads alike, so grouped-query attention keeps its
grouping), and the head-count attributes the attention module reads at forward are divided too
(``num_heads``, ``num_key_value_heads``, ``split_size``, ``hidden_size``...; ``head_dim`` and
``num_key_value_groups`` stay). Everything outside the layer list (embeddings, the final norm) and the
norms inside it stay replicated, as DeepSpeed's AutoTP training does by default; so does ``lm_head``,
except an untied one that the model's Hugging Face tensor-parallel plan marks ``colwise_gather_output``
(the Llama family), which DeepSpeed 0.19.8 slices column-parallel with the logits gathered: so does this.

Refused before anything is changed (the model is left as it was): a linear inside a layer that is not
in one of these patterns, a parameter-holding child of a recognised attention/MLP module that is not
one of its linears (e.g. Qwen3's ``q_norm``, whose gradient would be partial per rank), GPT-2
cross-attention, a model with no layer list (`NotImplementedError` naming the module); head counts,
key/value head counts or MLP widths that ``tp_size`` does not divide (`ValueError` naming the module
and the count).

DeepSpeed 0.19.8's ``deepspeed.tp_model_init`` only records its arguments and slices inside
``deepspeed.initialize``; this one slices at once (DeepSpeed's earlier behaviour) and casts the model
to ``dtype`` (what the engine does with the matching ``bf16``/``fp16`` section). Every rank must build
the same model (same seed or the same checkpoint): nothing is broadcast.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import ds_comm

from ._autotp_layers import LinearAllreduce, LinearLayer, _TPLinear, is_conv1d

logger = logging.getLogger(__name__)

_LLAMA_COLUMN = ("q_proj", "k_proj", "v_proj")
_ROW_ATTENTION = ("o_proj", "out_proj")
# Head-count attributes an attention module may read at forward (transformers 4.x/5.x), divided by tp_size.
_HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "hidden_size",
               "all_head_size", "embed_dim", "split_size", "inner_dim")

# tp_size -> (the default group they were made in, this rank's tensor-parallel group)
_GROUPS: dict[int, tuple[object, object]] = {}


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


def _out_features(module: nn.Module) -> int:
    return module.out_features if isinstance(module, nn.Linear) else module.weight.shape[1]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _divides(tp_size: int, count: int, module: str, what: str) -> None:
    if count % tp_size:
        raise ValueError(f"AutoTP: {module} has {what} = {count}, not divisible by tp_size {tp_size}; "
                         f"tp_size must divide it")


class _Plan:
    """The replacements to make, collected (and every refusal raised) before the model is touched."""

    def __init__(self, model: nn.Module, tp_size: int):
        self.model = model
        self.tp_size = tp_size
        self.column: list[tuple[str, int]] = []  # (qualified name, partition_stride)
        self.row: list[str] = []
        self.gathered: list[str] = []  # output heads sliced column-parallel with a gathered output
        self.attrs: list[tuple[nn.Module, str, int]] = []  # (attention module, attribute, new value)
        self._config = getattr(model, "config", None)
        self._covered: set[str] = set()

    # ---- recognition -----------------------------------------------------------------------------
    def build(self) -> _Plan:
        layers = self._layer_lists()
        if not layers:
            raise NotImplementedError(f"AutoTP cannot slice {type(self.model).__name__}: it has no nn.ModuleList of "
                                      "transformer layers (AutoTP recognises q/k/v/o and up/gate/down linears, and "
                                      "GPT-2's c_attn/c_proj/c_fc, inside the layers of such a list)")
        for prefix, layer in layers:
            for name, module in layer.named_modules(prefix=prefix):
                self._recognise(name, module)
            for name, module in layer.named_modules(prefix=prefix):
                if _is_linear(module) and name not in self._covered:
                    raise NotImplementedError(
                        f"AutoTP cannot slice module '{name}' ({type(module).__name__}): it is not part of a "
                        "recognised attention (q_proj/k_proj/v_proj + o_proj/out_proj, GPT-2 c_attn + c_proj) "
                        "or MLP (up_proj/gate_proj + down_proj, GPT-2 c_fc + c_proj) pattern")
        self._output_head()
        return self

    def _output_head(self) -> None:
        """DeepSpeed 0.19.8 follows a Hugging Face model's tensor-parallel plan, whose
        ``"lm_head": "colwise_gather_output"`` (Llama family) slices an untied head column-parallel with
        the logits gathered; a head tied to the input embedding (GPT-2, tied Llama) stays replicated here."""
        plan: dict = {}
        for source in (getattr(type(self.model), "_tp_plan", None), vars(self.model).get("_tp_plan")):
            if isinstance(source, dict):
                plan.update(source)
        embeddings = [m.weight for m in self.model.modules() if isinstance(m, nn.Embedding)]
        for name in ("lm_head", "embed_out"):
            head = getattr(self.model, name, None)
            if str(plan.get(name, "")).lower() not in ("colwise_gather_output", "colwise_rep"):
                continue
            if not isinstance(head, nn.Linear) or any(head.weight is w for w in embeddings):
                continue
            if head.out_features % self.tp_size:
                logger.info("AutoTP: %s left replicated: its %d outputs are not divisible by tp_size %d",
                            name, head.out_features, self.tp_size)
                continue
            self.gathered.append(name)

    def _layer_lists(self) -> list[tuple[str, nn.Module]]:
        layers: list[tuple[str, nn.Module]] = []
        inside: list[str] = []
        for name, module in self.model.named_modules():
            if not isinstance(module, nn.ModuleList):
                continue
            if any(name == p or name.startswith(p + ".") for p in inside):
                continue  # a list inside a layer (e.g. experts) belongs to that layer
            children = [(_join(name, n), c) for n, c in module.named_children()]
            layers.extend(children)
            inside.extend(n for n, _ in children)
        return layers

    def _recognise(self, name: str, module: nn.Module) -> None:
        kids = dict(module.named_children())
        if all(isinstance(kids.get(k), nn.Linear) for k in _LLAMA_COLUMN):
            row = next((k for k in _ROW_ATTENTION if isinstance(kids.get(k), nn.Linear)), None)
            if row is not None:
                self._llama_attention(name, module, kids, row)
                return
        if is_conv1d(kids.get("c_attn")) and is_conv1d(kids.get("c_proj")):
            self._gpt2_attention(name, module, kids)
            return
        if isinstance(kids.get("up_proj"), nn.Linear) and isinstance(kids.get("down_proj"), nn.Linear):
            column = ["up_proj"] + (["gate_proj"] if isinstance(kids.get("gate_proj"), nn.Linear) else [])
            self._mlp(name, module, kids, column, "down_proj")
            return
        if is_conv1d(kids.get("c_fc")) and is_conv1d(kids.get("c_proj")):
            self._mlp(name, module, kids, ["c_fc"], "c_proj")

    def _only(self, name: str, kids: dict[str, nn.Module], used: list[str]) -> None:
        """No parameter-holding child besides the linears being sliced."""
        for child, module in kids.items():
            if child not in used and any(True for _ in module.parameters()):
                raise NotImplementedError(
                    f"AutoTP cannot slice module '{_join(name, child)}' ({type(module).__name__}) of '{name}': a "
                    "module with parameters beside the sliced linears would see only this rank's heads/features")

    def _head_dim(self, name: str, module: nn.Module) -> int:
        head_dim = getattr(module, "head_dim", None)
        if head_dim is None and self._config is not None:
            head_dim = getattr(self._config, "head_dim", None)
            heads = getattr(self._config, "num_attention_heads", None)
            if head_dim is None and heads:
                head_dim = self._config.hidden_size // heads
        if not isinstance(head_dim, int) or head_dim < 1:
            raise NotImplementedError(f"AutoTP cannot slice module '{name}' ({type(module).__name__}): its head "
                                      "size is unknown (no head_dim attribute, no config.head_dim/num_attention_heads)")
        return head_dim

    def _divide_attrs(self, name: str, module: nn.Module) -> None:
        for attr in _HEAD_ATTRS:
            value = getattr(module, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                _divides(self.tp_size, value, f"'{name}'", attr)
                self.attrs.append((module, attr, value // self.tp_size))

    def _llama_attention(self, name: str, module: nn.Module, kids: dict[str, nn.Module], row: str) -> None:
        self._only(name, kids, [*_LLAMA_COLUMN, row])
        head_dim = self._head_dim(name, module)
        q, k, v = (kids[c] for c in _LLAMA_COLUMN)
        if q.out_features % head_dim or k.out_features % head_dim or k.out_features != v.out_features:
            raise NotImplementedError(
                f"AutoTP cannot slice module '{name}' ({type(module).__name__}): q_proj/k_proj/v_proj widths "
                f"{q.out_features}/{k.out_features}/{v.out_features} are not whole heads of {head_dim}")
        heads, kv_heads = q.out_features // head_dim, k.out_features // head_dim
        _divides(self.tp_size, heads, f"'{name}'", "num_attention_heads")
        _divides(self.tp_size, kv_heads, f"'{name}'", "num_key_value_heads (grouped-query attention)")
        self._divide_attrs(name, module)
        self.column.extend((_join(name, c), 1) for c in _LLAMA_COLUMN)
        self.row.append(_join(name, row))
        self._covered.update(_join(name, c) for c in (*_LLAMA_COLUMN, row))

    def _gpt2_attention(self, name: str, module: nn.Module, kids: dict[str, nn.Module]) -> None:
        if "q_attn" in kids or getattr(module, "is_cross_attention", False):
            raise NotImplementedError(f"AutoTP cannot slice module '{name}' ({type(module).__name__}): GPT-2 "
                                      "cross-attention (q_attn, c_attn = [k; v]) is not supported")
        self._only(name, kids, ["c_attn", "c_proj"])
        heads, split = getattr(module, "num_heads", None), getattr(module, "split_size", None)
        width = _out_features(kids["c_attn"])
        if not isinstance(heads, int) or not isinstance(split, int) or width != 3 * split:
            raise NotImplementedError(f"AutoTP cannot slice module '{name}' ({type(module).__name__}): c_attn "
                                      "is not a fused [q; k; v] of num_heads heads of split_size features")
        _divides(self.tp_size, heads, f"'{name}'", "num_heads")
        self._divide_attrs(name, module)
        self.column.append((_join(name, "c_attn"), 3))
        self.row.append(_join(name, "c_proj"))
        self._covered.update(_join(name, c) for c in ("c_attn", "c_proj"))

    def _mlp(self, name: str, module: nn.Module, kids: dict[str, nn.Module], column: list[str], row: str) -> None:
        self._only(name, kids, [*column, row])
        for c in column:
            _divides(self.tp_size, _out_features(kids[c]), f"'{_join(name, c)}'", "out_features")
        self.column.extend((_join(name, c), 1) for c in column)
        self.row.append(_join(name, row))
        self._covered.update(_join(name, c) for c in (*column, row))

    # ---- application ----------------------------------------------------------------------------
    def apply(self, group) -> None:
        def replace(qualified: str, make: Callable[[nn.Module], nn.Module]) -> None:
            parent_name, _, child = qualified.rpartition(".")
            parent = self.model.get_submodule(parent_name)
            setattr(parent, child, make(getattr(parent, child)))

        for qualified, stride in self.column:
            replace(qualified, lambda m, q=qualified, s=stride: LinearLayer(m, group, name=q, partition_stride=s))
        for qualified in self.row:
            replace(qualified, lambda m, q=qualified: LinearAllreduce(m, group, name=q))
        for qualified in self.gathered:
            replace(qualified, lambda m, q=qualified: LinearLayer(m, group, gather_output=True, name=q))
        for module, attr, value in self.attrs:
            setattr(module, attr, value)


def _resolve_group(tp_size: int, tp_group):
    """The tensor-parallel group: ``tp_group``, or ranks [k tp_size, (k+1) tp_size) of the default group
    (DeepSpeed's (data, tensor) mesh: tensor-parallel ranks are neighbours)."""
    if tp_group is not None:
        size = ds_comm.get_world_size(tp_group)
        if size != tp_size:
            raise ValueError(f"tp_model_init: tp_group has {size} ranks but tp_size is {tp_size}; they must match")
        return tp_group
    if not dist.is_initialized():
        raise RuntimeError(f"tp_model_init(tp_size={tp_size}) needs the default process group initialised "
                           "(ds_comm.init_distributed()) or a tp_group")
    world = ds_comm.get_world_size()
    if world % tp_size:
        raise ValueError(f"tp_model_init: tp_size {tp_size} does not divide the world size {world}")
    if world == tp_size:
        return dist.group.WORLD
    cached = _GROUPS.get(tp_size)
    if cached is not None and cached[0] is dist.group.WORLD:
        return cached[1]
    rank, mine = ds_comm.get_rank(), None
    for start in range(0, world, tp_size):  # every rank creates every group, in the same order
        group = ds_comm.new_group(list(range(start, start + tp_size)))
        if start <= rank < start + tp_size:
            mine = group
    _GROUPS[tp_size] = (dist.group.WORLD, mine)
    return mine


def tp_model_init(model: nn.Module, tp_size: int, dtype: torch.dtype, tp_group=None) -> nn.Module:
    """Slice ``model`` for tensor parallelism over ``tp_size`` ranks (DeepSpeed's ``deepspeed.tp_model_init``)
    and cast it to ``dtype``; returns the same model, marked ``ds_autotp_parsed``. Call it on every rank of
    the group with the same model. ``tp_group``: the tensor-parallel group (default: consecutive blocks of
    ``tp_size`` ranks of the default group). ``tp_size`` 1 only casts. See the module docstring for what is
    sliced and what is refused."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"tp_model_init: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tp_model_init: tp_size must be an int >= 1, got {tp_size!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"tp_model_init: dtype must be a floating torch.dtype (torch.float32, torch.float16, "
                         f"torch.bfloat16), got {dtype!r}")
    if getattr(model, "ds_autotp_parsed", False):
        done = getattr(model, "_ds_autotp_size", None)
        if done != tp_size:
            raise RuntimeError(f"tp_model_init: the model was already sliced with tp_size {done}, "
                               f"cannot slice it again with tp_size {tp_size}")
        logger.warning("tp_model_init: the model is already sliced (ds_autotp_parsed); left as it is")
        return model
    if tp_size > 1:
        plan = _Plan(model, tp_size).build()  # every refusal before any change
        group = _resolve_group(tp_size, tp_group)
        plan.apply(group)
        logger.info("AutoTP: %d column-parallel and %d row-parallel linears, %d gathered output heads over "
                    "tp_size %d", len(plan.column), len(plan.row), len(plan.gathered), tp_size)
    elif tp_group is not None and ds_comm.get_world_size(tp_group) != 1:
        raise ValueError(f"tp_model_init: tp_group has {ds_comm.get_world_size(tp_group)} ranks but tp_size is 1")
    model.to(dtype)
    model.ds_autotp_parsed = True
    model._ds_autotp_size = tp_size
    return model


def replace_module_consolidated_state_dict(model: nn.Module, *, rank0_only: bool = True) -> OrderedDict | None:
    """The full (unsliced) state dict of a model sliced by `tp_model_init` (DeepSpeed's engine method
    ``_replace_module_consolidated_state_dict``, what ``_consolidated_16bit_state_dict`` /
    ``save_16bit_model`` use under AutoTP): the model's own ``state_dict()`` keys, each `LinearLayer` /
    `LinearAllreduce` weight and bias gathered over its group and given back in the layout of the module
    it replaced (GPT-2's ``Conv1D``: [in, out]); tensors copied to the CPU. A collective: call it on every
    rank. Returns the dict on global rank 0 and None elsewhere (DeepSpeed's behaviour), or on every rank
    with ``rank0_only=False``."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"replace_module_consolidated_state_dict: model must be a torch.nn.Module, got "
                         f"{type(model).__name__}")
    state = model.state_dict()
    for name, module in model.named_modules():
        if isinstance(module, _TPLinear):
            for key, full in module.gathered_state().items():
                state[_join(name, key)] = full
    if rank0_only and dist.is_initialized() and ds_comm.get_rank() != 0:
        return None
    return OrderedDict((key, value.detach().to("cpu", copy=True)) for key, value in state.items())
