"""The engine's ``__getattr__`` (issue 44): a name the engine lacks is read from the model, as DeepSpeed's engine
does (deepspeed/runtime/engine.py ``__getattr__``), but the engine's own names never are: an AttributeError raised
inside one of its properties (a part lacking what the property reads) is that error, not the model's attribute of
the same name, and a part read before the engine built it is an error."""

from __future__ import annotations

import torch
from torch import nn

import ds_all
from ds_comm.testing import spawn


class Model(nn.Module):
    """A model with attributes named as the engine's own (a property and a part) and one of its own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 1)
        self.has_moe_layers = "the model's"
        self.moe_wiring = "the model's"
        self.vocabulary = "the model's"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class PartWithout:
    """A part lacking every attribute the engine's properties read."""


def _error(read) -> str:
    try:
        return f"returned {read()!r}"
    except AttributeError as e:
        return f"AttributeError: {e}"


def reads(rank: int, world_size: int) -> dict[str, str]:
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = ds_all.initialize(model=Model(), config=config)
    out = {"forwarded": _error(lambda: engine.vocabulary), "misspelt": _error(lambda: engine.has_moe_layer),
           "built": _error(lambda: engine.has_moe_layers), "part": _error(lambda: type(engine.moe_wiring).__name__)}
    wiring = engine.moe_wiring
    engine.moe_wiring = PartWithout()  # the property's part lacks what it reads
    out["part lacks"] = _error(lambda: engine.has_moe_layers)
    del engine.moe_wiring  # the part not built
    out["no part"] = _error(lambda: engine.moe_wiring)
    out["property of no part"] = _error(lambda: engine.has_moe_layers)
    engine.moe_wiring = wiring
    engine.parallel_groups, groups = PartWithout(), engine.parallel_groups
    out["groups part lacks"] = _error(lambda: engine.dp_world_size)
    engine.parallel_groups = groups
    engine.has_moe_layers, engine.checkpoint_mp_rank = True, 3  # DeepSpeed's are plain attributes: assignable
    out["assigned"] = f"{engine.has_moe_layers} {engine.moe_wiring.has_moe_layers} {engine.checkpoint_mp_rank}"
    engine.has_moe_layers = False
    engine.destroy()
    return out


def test_missing_names_read_the_model_but_the_engine_s_own_names_raise_their_own_error():
    (out,) = spawn(reads, world_size=1)
    assert out["forwarded"] == "returned \"the model's\""  # DeepSpeed's pass-through, kept
    assert out["misspelt"] == "AttributeError: 'DeepSpeedEngine' object has no attribute 'has_moe_layer'"
    assert out["built"] == "returned False" and out["part"] == "returned 'MoEWiring'"
    # the property's own error, not the model's has_moe_layers
    assert out["part lacks"] == "AttributeError: 'PartWithout' object has no attribute 'has_moe_layers'"
    assert out["groups part lacks"] == "AttributeError: 'PartWithout' object has no attribute 'dp_world_size'"
    # a part not built: neither it nor a property reading it is the model's
    assert out["no part"].startswith("AttributeError: 'DeepSpeedEngine' object has no part 'moe_wiring' yet")
    assert out["property of no part"] == out["no part"]
    assert out["assigned"] == "True True 3"  # written to the part that owns it
