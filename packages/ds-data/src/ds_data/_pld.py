"""Progressive layer dropping (Zhang & He, 2020, "Accelerating Training of Transformer-Based Language Models
with Progressive Layer Dropping").

`ProgressiveLayerDrop` is DeepSpeed's theta schedule: the keep ratio starts at 1 and falls towards ``theta``,
``theta(t) = (1 - theta) * exp(-gamma * t) + theta``. `ProgressiveLayerDropBlock` is the layer side, which
DeepSpeed leaves to the model: in training, block ``i`` of ``L`` runs with probability
``p_i = 1 - (i + 1) / L * (1 - theta(t))`` (deeper blocks are dropped more often, the last with probability
``1 - theta``) and is the identity otherwise; a block that runs has its residual branch scaled by ``1 / p_i``
so that its expected output is the plain block's. In evaluation every block runs, unscaled.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from torch import nn

from .config import ProgressiveLayerDropConfig

logger = logging.getLogger(__name__)


class ProgressiveLayerDrop:
    """DeepSpeed's ``ProgressiveLayerDrop``: ``get_theta()`` is 1.0 until the first `update_state`;
    ``update_state(global_step)`` sets it to ``(1 - theta) * exp(-gamma * global_step) + theta``."""

    def __init__(self, theta: float = 0.5, gamma: float = 0.001) -> None:
        section = ProgressiveLayerDropConfig(theta=theta, gamma=gamma)  # the values checked, named when bad
        self.theta, self.gamma = section.theta, section.gamma
        self.current_theta = 1.0
        logger.info("progressive layer dropping enabled (theta = %s, gamma = %s)", self.theta, self.gamma)

    def get_state(self) -> dict[str, Any]:
        """The keyword arguments the engine passes to the model's forward."""
        return {"progressive_layer_drop": True, "pld_theta": self.get_theta()}

    def get_theta(self) -> float:
        return self.current_theta

    def update_state(self, global_step: int) -> None:
        # numpy's exp, as DeepSpeed computes it (the same float at every step)
        self.current_theta = float((1.0 - self.theta) * np.exp(-self.gamma * global_step) + self.theta)

    def state_dict(self) -> dict[str, float]:
        return {"theta": self.theta, "gamma": self.gamma, "current_theta": self.current_theta}

    def load_state_dict(self, state: dict[str, float]) -> None:
        if not isinstance(state, dict) or set(state) != {"theta", "gamma", "current_theta"}:
            raise ValueError(f"a ProgressiveLayerDrop state has the keys theta, gamma, current_theta, got {state!r}")
        section = ProgressiveLayerDropConfig(theta=state["theta"], gamma=state["gamma"])
        current = state["current_theta"]
        if isinstance(current, bool) or not isinstance(current, (int, float)) or not 0.0 < current <= 1.0:
            raise ValueError(f"a ProgressiveLayerDrop state's current_theta must be in (0, 1], got {current!r}")
        self.theta, self.gamma, self.current_theta = section.theta, section.gamma, float(current)


class ProgressiveLayerDropBlock(nn.Module):
    """A residual block (``out = x + f(x)``, as a pre-LN transformer block) that progressive layer dropping
    may skip. ``layer_index`` counts from 0 to ``num_layers - 1`` (the paper's ``i`` is ``layer_index + 1``).

    ``forward(x, *args, pld_theta=None, progressive_layer_drop=None, **kwargs)``: in training with a
    ``pld_theta``, the block runs with probability ``p = 1 - (layer_index + 1) / num_layers * (1 - pld_theta)``
    and returns ``x + (block(x) - x) / p``, else returns ``x`` unchanged (no random number is drawn when
    ``p == 1``, and the block's own output is returned as it is: theta 1 is the plain model exactly). In
    evaluation, or without ``pld_theta``, it is ``block(x, *args, **kwargs)``. The draw uses ``generator``
    (default: torch's global one); data-parallel ranks may skip different blocks (under ds-all's ZeRO the replicas
    stay equal), seeded alike they skip the same ones."""

    def __init__(self, block: nn.Module, layer_index: int, num_layers: int,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        if not isinstance(block, nn.Module):
            raise ValueError(f"ProgressiveLayerDropBlock wraps a torch.nn.Module, got {type(block).__name__}")
        for name, value in (("layer_index", layer_index), ("num_layers", num_layers)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"ProgressiveLayerDropBlock: {name} must be an integer, got {value!r}")
        if num_layers < 1 or not 0 <= layer_index < num_layers:
            raise ValueError(f"ProgressiveLayerDropBlock: layer_index must be in [0, num_layers) and num_layers >= 1, "
                             f"got layer_index {layer_index} and num_layers {num_layers}")
        self.block, self.layer_index, self.num_layers, self.generator = block, layer_index, num_layers, generator

    def keep_probability(self, theta: float) -> float:
        """``1 - (layer_index + 1) / num_layers * (1 - theta)``."""
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0.0 < theta <= 1.0:
            raise ValueError(f"pld_theta must be a number in (0, 1], got {theta!r}")
        return 1.0 - (self.layer_index + 1) / self.num_layers * (1.0 - theta)

    def forward(self, x: torch.Tensor, *args: Any, pld_theta: float | None = None,
                progressive_layer_drop: bool | None = None, **kwargs: Any) -> torch.Tensor:
        if not self.training or pld_theta is None or progressive_layer_drop is False:
            return self.block(x, *args, **kwargs)
        keep = self.keep_probability(pld_theta)
        if keep >= 1.0:
            return self.block(x, *args, **kwargs)
        if torch.rand((), generator=self.generator).item() >= keep:
            return x  # skipped: the identity
        out = self.block(x, *args, **kwargs)
        if not torch.is_tensor(out) or out.shape != x.shape:
            raise ValueError("ProgressiveLayerDropBlock needs a block that returns a tensor of its input's shape "
                             f"(x + f(x)), got {type(out).__name__}"
                             f"{' of shape ' + str(tuple(out.shape)) if torch.is_tensor(out) else ''}")
        return x + (out - x) / keep

    def extra_repr(self) -> str:
        return f"layer_index={self.layer_index}, num_layers={self.num_layers}"
