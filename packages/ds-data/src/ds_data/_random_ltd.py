"""Random layerwise token dropping (random-LTD; Yao et al., 2022, "Random-LTD: Random and Layerwise Token
Dropping Brings Efficient Training for Large-scale Transformers").

`RandomLayerTokenDrop` wraps a transformer layer: in training, with a ``reserved_length`` below the sequence
length, each sample keeps a uniformly random subset of ``reserved_length`` of its tokens (in their original
order), the layer runs on the kept tokens alone (its attention mask and position ids gathered at the same
tokens) and its outputs are scattered back into the full sequence; the dropped tokens pass the layer unchanged.
Otherwise the wrapper is the layer. `convert_to_random_ltd` wraps a model's layers of a type;
`RandomLTDScheduler` is DeepSpeed's schedule of the kept length (``fixed_linear``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .config import RANDOM_LTD, RandomLTDConfig

logger = logging.getLogger(__name__)

ORDERS = ("batch_seq_dim", "seq_batch_dim")
_STATE_KEYS = ("consumed_layer_tokens", "current_steps", "current_value", "min_value", "max_value")


def _section(config: Any) -> RandomLTDConfig:
    if isinstance(config, RandomLTDConfig):
        section = config
    elif isinstance(config, Mapping):
        section = RandomLTDConfig.model_validate(dict(config))
    else:
        raise ValueError(f"random-LTD: config must be a dict of the random_ltd keys or a RandomLTDConfig, got "
                         f"{type(config).__name__}")
    section.check_complete()
    return section


class RandomLTDScheduler:
    """DeepSpeed's ``RandomLTDScheduler``: the tokens each random-LTD layer keeps at each step.

    ``fixed_linear``: ``v(t) = floor(t / require_steps * (max_value - min_value) + min_value)``, rounded down to a
    multiple of ``seq_per_step``, capped at ``max_value``. The current value starts at ``min_value``;
    ``update_seq(global_steps)`` moves it to ``v(global_steps)`` while it is below ``max_value`` (once there it
    stays) and counts the layer-tokens of the step once per step (``global_batch_size`` samples,
    ``random_ltd_layer_num`` layers at the current value, the other ``total_layer_num - random_ltd_layer_num``
    at ``max_value``). ``config``: the ``random_ltd`` keys (a dict or a `RandomLTDConfig`)."""

    def __init__(self, config: Mapping[str, Any] | RandomLTDConfig, global_batch_size: int = 1) -> None:
        if isinstance(config, Mapping) and "global_batch_size" in config:  # DeepSpeed's engine adds these two keys
            global_batch_size = config["global_batch_size"]
            config = {k: v for k, v in config.items() if k not in ("global_batch_size", "micro_batch_size")}
        section = _section(config)
        if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
            raise ValueError(f"RandomLTDScheduler: global_batch_size must be a positive integer, got "
                             f"{global_batch_size!r}")
        if section.layer_token_lr_schedule.enabled:
            raise NotImplementedError(f"{RANDOM_LTD}.layer_token_lr_schedule is not implemented (DeepSpeed refuses it "
                                      "too: work in progress); remove it or set enabled false")
        self.model_layer_num = section.total_layer_num
        self.random_ltd_layer_num = section.random_ltd_layer_num
        self.global_batch_size = global_batch_size
        self.config_schedule = section.random_ltd_schedule
        self.state: dict[str, Any] = {}
        self.reset_to_init()

    def reset_to_init(self) -> None:
        schedule = self.config_schedule
        self.state = {"min_value": schedule.min_value, "max_value": schedule.max_value,
                      "current_value": schedule.min_value, "schedule_type": schedule.schedule_type,
                      "schedule_config": schedule.schedule_config.model_dump(),
                      "consumed_layer_tokens": 0, "current_steps": -1}

    def get_value(self, global_steps: int) -> int:
        """The schedule's value at ``global_steps`` (the current value is not changed)."""
        if self.state["schedule_type"] != "fixed_linear":
            raise RuntimeError(f"random-LTD schedule_type {self.state['schedule_type']!r} is not fixed_linear")
        schedule = self.state["schedule_config"]
        low, high = self.state["min_value"], self.state["max_value"]
        fraction = (float(global_steps) / schedule["require_steps"]) ** (1.0 / 1)
        value = math.floor(fraction * (high - low) + low)
        value -= value % schedule["seq_per_step"]
        return min(value, high)

    def update_seq(self, global_steps: int) -> int:
        """Move the current value to the schedule's at ``global_steps`` (unless at ``max_value``), count the
        step's layer-tokens once; return the current value."""
        if self.state["current_value"] < self.state["max_value"]:
            self.state["current_value"] = self.get_value(global_steps)
        if global_steps != self.state["current_steps"]:
            dropped = self.state["current_value"] * self.random_ltd_layer_num
            full = self.state["max_value"] * (self.model_layer_num - self.random_ltd_layer_num)
            self.state["consumed_layer_tokens"] += self.global_batch_size * (dropped + full)
            self.state["current_steps"] = global_steps
        return self.state["current_value"]

    def get_total_layer_tokens(self, train_iters: int) -> int:
        """DeepSpeed's: runs `update_seq` over steps ``0 .. train_iters - 1`` on this scheduler (its state moves)
        and returns the layer-tokens consumed."""
        for step in range(train_iters):
            self.update_seq(step)
        return self.state["consumed_layer_tokens"]

    def get_current_seq(self) -> int:
        return self.state["current_value"]

    def set_current_seq(self, seq_length: int) -> None:
        if isinstance(seq_length, bool) or not isinstance(seq_length, int) or seq_length < 1:
            raise ValueError(f"set_current_seq needs a positive integer, got {seq_length!r}")
        self.state["current_value"] = seq_length

    def get_random_ltd_layer_num(self) -> int:
        return self.random_ltd_layer_num

    def get_state(self) -> dict[str, Any]:
        return self.state

    def set_state(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, int]:
        """DeepSpeed's five keys: consumed_layer_tokens, current_steps, current_value, min_value, max_value."""
        return {key: self.state[key] for key in _STATE_KEYS}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or set(state) != set(_STATE_KEYS):
            got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"a RandomLTDScheduler state has the keys {list(_STATE_KEYS)}, got {got}")
        for key in _STATE_KEYS:
            value = state[key]
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"a RandomLTDScheduler state's {key} must be an integer, got {value!r}")
        self.state.update({key: state[key] for key in _STATE_KEYS})


def _check_length(value: Any) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"RandomLayerTokenDrop.reserved_length must be a positive integer or None, got {value!r}")
    return value


class RandomLayerTokenDrop(nn.Module):
    """A layer that random-LTD may run on a subset of the tokens (DeepSpeed's ``RandomLayerTokenDrop``).

    ``forward(hidden_states, *args, **kwargs)``: in training with ``reserved_length`` (an int) below the
    sequence length, sample per sample ``reserved_length`` distinct token indices uniformly (sorted), gather
    ``hidden_states`` (``[batch, seq, ...]`` for ``hidden_state_order`` "batch_seq_dim", ``[seq, batch, ...]``
    for "seq_batch_dim") at them, gather the keyword ``mask_name`` (``[b, s]``, ``[b, s, s]`` or
    ``[b, heads, s, s]``, additive or boolean; a batch or heads dimension of 1 is broadcast) and the keyword
    ``position_ids_name`` (``[b, s]``, ``[1, s]`` or ``[s]``) at them, run the layer, and scatter its output
    (the tensor, or a tuple's first element) into the input at those indices. Other positional arguments
    pass unchanged. In evaluation, with ``reserved_length`` None, or at or above the sequence length, it is
    ``layer(hidden_states, *args, **kwargs)`` exactly.

    The draws use ``generator`` when given (on its own device; the indices are moved to the hidden states'),
    else the global generator of the hidden states' device, as DeepSpeed draws (so each data-parallel rank
    draws its own, and activation checkpointing, which restores that generator, recomputes the same tokens).
    ``last_indices`` holds the ``[batch, reserved_length]`` indices of the last dropping forward."""

    def __init__(self, layer: nn.Module, *, hidden_state_order: str = "batch_seq_dim", mask_name: str | None = None,
                 position_ids_name: str | None = "position_ids", model_type: str = "decoder",
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        if not isinstance(layer, nn.Module):
            raise ValueError(f"RandomLayerTokenDrop wraps a torch.nn.Module, got {type(layer).__name__}")
        self.random_ltd_layer = layer  # DeepSpeed's attribute name: state-dict keys match its converted models
        self.set_options(hidden_state_order=hidden_state_order, mask_name=mask_name,
                         position_ids_name=position_ids_name, model_type=model_type)
        self.generator = generator
        self._reserved_length: int | None = None
        self.random_ltd_layer_id: int | None = None
        self.last_indices: torch.Tensor | None = None

    def set_options(self, *, hidden_state_order: str, mask_name: str | None, position_ids_name: str | None,
                    model_type: str) -> None:
        if hidden_state_order not in ORDERS:
            raise ValueError(f"RandomLayerTokenDrop: hidden_state_order must be one of {', '.join(map(repr, ORDERS))}, "
                             f"got {hidden_state_order!r}")
        if model_type not in ("decoder", "encoder"):
            raise ValueError(f"RandomLayerTokenDrop: model_type must be 'decoder' or 'encoder', got {model_type!r}")
        self.hidden_state_order, self.batch_first = hidden_state_order, hidden_state_order == "batch_seq_dim"
        self.mask_name, self.position_ids_name, self.model_type = mask_name, position_ids_name, model_type

    def init_config(self, config: RandomLTDConfig, random_ltd_layer_id: int) -> None:
        """Take the options of a ``random_ltd`` section (the engine calls it for each chosen layer)."""
        self.set_options(hidden_state_order=config.hidden_state_order, mask_name=config.model_mask_name,
                         position_ids_name=self.position_ids_name, model_type=config.model_type)
        self.random_ltd_layer_id = random_ltd_layer_id

    @property
    def reserved_length(self) -> int | None:
        return self._reserved_length

    @reserved_length.setter
    def reserved_length(self, value: int | None) -> None:
        self._reserved_length = _check_length(value)

    # ------------------------------------------------------------------------- the tokens
    def sample_indices(self, batch: int, seq: int, device: torch.device) -> torch.Tensor:
        """``[batch, reserved_length]`` sorted distinct token indices per sample (int64, on ``device``)."""
        where = self.generator.device if self.generator is not None else device
        keys = torch.rand(batch, seq, generator=self.generator, device=where)
        indices = keys.topk(self.reserved_length, dim=1).indices.sort(dim=1).values
        return indices.to(device)

    def _gather(self, hidden: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        dim = 1 if self.batch_first else 0
        index = indices if self.batch_first else indices.t()
        return torch.gather(hidden, dim, index.reshape(*index.shape, *[1] * (hidden.dim() - 2))
                            .expand(*index.shape, *hidden.shape[2:]))

    def _scatter(self, hidden: torch.Tensor, part: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        dim = 1 if self.batch_first else 0
        index = indices if self.batch_first else indices.t()
        index = index.reshape(*index.shape, *[1] * (hidden.dim() - 2)).expand(*index.shape, *hidden.shape[2:])
        return hidden.to(part.dtype).scatter(dim, index, part)

    @staticmethod
    def _gather_mask(mask: torch.Tensor, indices: torch.Tensor, seq: int) -> torch.Tensor:
        batch, kept = indices.shape
        if mask.dim() not in (2, 3, 4) or mask.shape[-1] != seq or (mask.dim() > 2 and mask.shape[-2] != seq) \
                or mask.shape[0] not in (1, batch):
            raise ValueError(f"random-LTD: the attention mask must be [batch, seq], [batch, seq, seq] or "
                             f"[batch, heads, seq, seq] (batch {batch} or 1, seq {seq}), got {tuple(mask.shape)}")
        if mask.dim() == 2:
            return mask.expand(batch, seq).gather(1, indices)
        if mask.dim() == 3:
            rows = mask.expand(batch, seq, seq).gather(1, indices[:, :, None].expand(batch, kept, seq))
            return rows.gather(2, indices[:, None, :].expand(batch, kept, kept))
        heads = mask.shape[1]
        mask = mask.expand(batch, heads, seq, seq)
        rows = mask.gather(2, indices[:, None, :, None].expand(batch, heads, kept, seq))
        return rows.gather(3, indices[:, None, None, :].expand(batch, heads, kept, kept))

    @staticmethod
    def _gather_positions(positions: torch.Tensor, indices: torch.Tensor, seq: int) -> torch.Tensor:
        batch = indices.shape[0]
        if positions.dim() not in (1, 2) or positions.shape[-1] != seq or \
                (positions.dim() == 2 and positions.shape[0] not in (1, batch)):
            raise ValueError(f"random-LTD: position ids must be [batch, seq], [1, seq] or [seq] (batch {batch}, seq "
                             f"{seq}), got {tuple(positions.shape)}")
        return positions.expand(batch, seq).gather(1, indices)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        seq_dim = 1 if self.batch_first else 0
        kept = self._reserved_length
        if not self.training or kept is None or kept >= hidden_states.shape[seq_dim]:
            return self.random_ltd_layer(hidden_states, *args, **kwargs)
        seq, batch = hidden_states.shape[seq_dim], hidden_states.shape[1 - seq_dim]
        indices = self.sample_indices(batch, seq, hidden_states.device)
        self.last_indices = indices
        for name, gather in ((self.mask_name, self._gather_mask), (self.position_ids_name, self._gather_positions)):
            if name is not None and kwargs.get(name) is not None:
                kwargs[name] = gather(kwargs[name], indices, seq)
        outputs = self.random_ltd_layer(self._gather(hidden_states, indices), *args, **kwargs)
        first = outputs[0] if isinstance(outputs, tuple) else outputs
        expected = (batch, kept) if self.batch_first else (kept, batch)
        if not torch.is_tensor(first) or tuple(first.shape[:2]) != expected:
            raise ValueError(f"RandomLayerTokenDrop: the layer must return its hidden states ({expected} first, or a "
                             f"tuple starting with them), got {type(first).__name__}"
                             f"{' of shape ' + str(tuple(first.shape)) if torch.is_tensor(first) else ''}")
        full = self._scatter(hidden_states, first, indices)
        return (full, *outputs[1:]) if isinstance(outputs, tuple) else full

    def extra_repr(self) -> str:
        return f"hidden_state_order={self.hidden_state_order!r}, reserved_length={self._reserved_length}"


def convert_to_random_ltd(model: Any, convert_type: type | tuple[type, ...], *,
                          layer_ids: Sequence[int] | None = None) -> Any:
    """Wrap every submodule of type ``convert_type`` of ``model`` (outermost ones; an engine's ``module``) in a
    `RandomLayerTokenDrop`, in place, and return ``model``. ``layer_ids``: wrap only those (indices, in module
    order, among the modules of that type). An engine (anything with ``random_ltd_initialize``) then picks its
    ``random_ltd_layer_id`` layers among the wrapped ones, as DeepSpeed's function does."""
    if not (isinstance(convert_type, type) or (isinstance(convert_type, tuple) and convert_type
                                               and all(isinstance(t, type) for t in convert_type))):
        raise ValueError(f"convert_to_random_ltd: convert_type must be a class or a tuple of classes, got "
                         f"{convert_type!r}")
    engine = model if hasattr(model, "random_ltd_initialize") else None
    root = model.module if engine is not None else model
    if not isinstance(root, nn.Module):
        raise ValueError(f"convert_to_random_ltd needs a torch.nn.Module or an engine, got {type(model).__name__}")
    if isinstance(root, convert_type):
        raise ValueError(f"convert_to_random_ltd: the model itself is a {root.__class__.__name__}; convert its layers")
    found: list[tuple[nn.Module, str]] = []

    def visit(parent: nn.Module) -> None:
        for name, child in parent.named_children():
            if isinstance(child, RandomLayerTokenDrop):
                continue
            if isinstance(child, convert_type):
                found.append((parent, name))
            else:
                visit(child)

    visit(root)
    if not found:
        raise ValueError(f"convert_to_random_ltd: the model has no {convert_type!r} module outside a random-LTD wrapper")
    chosen = range(len(found)) if layer_ids is None else list(layer_ids)
    bad = [i for i in chosen if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(found)]
    if bad:
        raise ValueError(f"convert_to_random_ltd: layer_ids {bad} out of range: the model has {len(found)} such "
                         f"modules (0 to {len(found) - 1})")
    for i in chosen:
        parent, name = found[i]
        setattr(parent, name, RandomLayerTokenDrop(getattr(parent, name)))
    if engine is not None:
        engine.random_ltd_initialize()
    return model

