"""AutoTP by rules instead of by recognised names: DeepSpeed's ``tensor_parallel.partition_config``.

A rule (`TPLayerSpec`) names parameters by regular expressions (``re.match`` on ``"<module>.weight"``) and
says how their module is split: ``"column"`` (`LinearLayer`: output features, optionally with the output
gathered), ``"row"`` (`LinearAllreduce`: input features, partial products all-reduced) or ``"skip"`` (left
whole on every rank). `apply_partition_config` walks the model's modules in order; a module with a 2-D
``weight`` is split by the first rule that matches it, left whole when none does (``strict_mode``: a
``ValueError`` naming it), and not looked into further. Uneven splits follow `get_shard_size_list`.

DeepSpeed's rule keys beyond these (a logical ``shape`` of fused sub-parameters, another ``partition_dim``,
``grad_allreduce``, splitting embeddings) are refused by name when a rule that uses them matches.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ._autotp_layers import LinearAllreduce, LinearLayer, _TPLinear, group_world_rank

logger = logging.getLogger(__name__)

_TYPES = ("column", "row", "skip")
_SPEC_KEYS = {"patterns", "partition_type", "gather_output", "grad_allreduce", "shape", "partition_dim",
              "model_types"}
_CONFIG_KEYS = {"tp_size", "layer_specs", "embedding_partition_dim", "lm_head_patterns", "use_default_specs",
                "strict_mode"}


@dataclass
class TPLayerSpec:
    """One rule of a partition config (DeepSpeed's ``TPLayerSpec``): ``patterns`` (regular expressions matched
    with ``re.match`` against ``"<module name>.weight"``), ``partition_type`` (``"column"``, ``"row"`` or
    ``"skip"``), ``gather_output`` (column only: every rank gets the whole output), ``model_types`` (apply only
    to models whose ``config.model_type`` is one of these). ``shape``, ``partition_dim`` and ``grad_allreduce``
    are DeepSpeed's and are refused when the rule is used."""

    patterns: list[str]
    partition_type: str = "column"
    gather_output: bool = False
    model_types: list[str] | None = None
    shape: Any = None
    partition_dim: int | None = None
    grad_allreduce: bool = False
    _compiled: list[re.Pattern] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.patterns, str) or not isinstance(self.patterns, (list, tuple)) or not all(
                isinstance(p, str) for p in self.patterns):
            raise ValueError(f"TPLayerSpec: patterns must be a list of regular expressions, got {self.patterns!r}")
        kind = str(getattr(self.partition_type, "value", self.partition_type)).lower()
        if kind not in _TYPES:
            raise ValueError(f"TPLayerSpec: partition_type must be one of {', '.join(_TYPES)}, got "
                             f"{self.partition_type!r}")
        self.partition_type = kind
        if not isinstance(self.gather_output, bool):
            raise ValueError(f"TPLayerSpec: gather_output must be true or false, got {self.gather_output!r}")
        if self.gather_output and kind != "column":
            raise ValueError(f"TPLayerSpec {self.patterns}: gather_output applies to column-parallel rules, this one "
                             f"is {kind!r}")
        if self.model_types is not None and (isinstance(self.model_types, str) or not all(
                isinstance(t, str) for t in self.model_types)):
            raise ValueError(f"TPLayerSpec: model_types must be a list of model type names, got {self.model_types!r}")
        try:
            self._compiled = [re.compile(p) for p in self.patterns]
        except re.error as err:
            raise ValueError(f"TPLayerSpec: a pattern of {self.patterns} is not a regular expression: {err}") from None

    def matches(self, param_name: str, model_type: str | None = None) -> bool:
        """Whether this rule applies to the parameter ``param_name`` of a model of type ``model_type``."""
        if self.model_types and (model_type is None
                                 or str(model_type).lower() not in {t.lower() for t in self.model_types}):
            return False
        return any(p.match(param_name) for p in self._compiled)

    def unsupported(self) -> str | None:
        if self.shape is not None:
            return f"shape {self.shape!r} (fused sub-parameters)"
        if self.partition_dim is not None and self.partition_dim != (0 if self.partition_type == "column" else 1):
            return f"partition_dim {self.partition_dim!r}"
        if self.grad_allreduce:
            return "grad_allreduce"
        return None


@dataclass
class AutoTPConfig:
    """A partition config (DeepSpeed's ``AutoTPConfig``): the rules in order (the first match wins) and
    ``strict_mode`` (a module with a 2-D weight that no rule matches is an error). `from_dict` reads the JSON
    form of ``tensor_parallel.partition_config``."""

    layer_specs: list[TPLayerSpec] = field(default_factory=list)
    strict_mode: bool = False
    tp_size: int = 1
    use_default_specs: bool = True
    lm_head_patterns: list[str] = field(default_factory=lambda: ["lm_head", "embed_out"])
    embedding_partition_dim: int = 1

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> AutoTPConfig:
        if not isinstance(config, dict):
            raise ValueError(f"partition_config must be a dict, got {type(config).__name__}")
        unknown = sorted(set(config) - _CONFIG_KEYS)
        if unknown:
            raise ValueError(f"partition_config: unknown key(s) {', '.join(unknown)}; the keys are "
                             f"{', '.join(sorted(_CONFIG_KEYS))}")
        specs = config.get("layer_specs", [])
        if not isinstance(specs, list):
            raise ValueError(f"partition_config.layer_specs must be a list of rules, got {type(specs).__name__}")
        rules = []
        for i, spec in enumerate(specs):
            if not isinstance(spec, dict):
                raise ValueError(f"partition_config.layer_specs[{i}] must be a dict, got {type(spec).__name__}")
            bad = sorted(set(spec) - _SPEC_KEYS)
            if bad:
                raise ValueError(f"partition_config.layer_specs[{i}]: unknown key(s) {', '.join(bad)}; the keys are "
                                 f"{', '.join(sorted(_SPEC_KEYS))}")
            if "patterns" not in spec:
                raise ValueError(f"partition_config.layer_specs[{i}] has no patterns")
            rules.append(TPLayerSpec(**spec))
        return cls(layer_specs=rules, strict_mode=bool(config.get("strict_mode", False)),
                   tp_size=config.get("tp_size", 1), use_default_specs=bool(config.get("use_default_specs", True)),
                   lm_head_patterns=list(config.get("lm_head_patterns", ["lm_head", "embed_out"])),
                   embedding_partition_dim=config.get("embedding_partition_dim", 1))

    def find_matching_spec(self, param_name: str, model_type: str | None = None) -> TPLayerSpec | None:
        """The first rule that matches ``param_name``, or None."""
        return next((spec for spec in self.layer_specs if spec.matches(param_name, model_type)), None)


def apply_partition_config(model: nn.Module, config: AutoTPConfig | dict[str, Any], tp_group) -> nn.Module:
    """Split ``model``'s modules over ``tp_group`` by ``config``'s rules, in place (module docstring), and mark
    it ``ds_autotp_parsed``. Returns the model. Every refusal is raised before the model is changed."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"apply_partition_config: model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(config, dict):
        config = AutoTPConfig.from_dict(config)
    if not isinstance(config, AutoTPConfig):
        raise ValueError(f"apply_partition_config: config must be an AutoTPConfig or its dict, got "
                         f"{type(config).__name__}")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    plan: list[tuple[str, TPLayerSpec]] = []

    def visit(module: nn.Module, prefix: str) -> None:
        for child_name, child in module.named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            weight = getattr(child, "weight", None)
            if isinstance(child, _TPLinear):
                continue  # split already
            if not (isinstance(weight, nn.Parameter) and weight.dim() == 2):
                visit(child, name)
                continue
            spec = config.find_matching_spec(f"{name}.weight", model_type)
            if spec is None:
                if config.strict_mode:
                    raise ValueError(f"partition_config (strict_mode): no rule matches {name}.weight "
                                     f"({type(child).__name__})")
                continue
            if spec.partition_type == "skip":
                continue
            why = spec.unsupported()
            if why is not None:
                raise NotImplementedError(f"partition_config: the rule {spec.patterns} matching {name}.weight uses "
                                          f"{why}, which ds-parallel does not build")
            if not isinstance(child, nn.Linear):
                raise NotImplementedError(f"partition_config: {name} is a {type(child).__name__}; ds-parallel splits "
                                          "nn.Linear modules only (an embedding or other 2-D weight: use 'skip')")
            plan.append((name, spec))

    visit(model, "")
    world, _ = group_world_rank(tp_group)
    for name, spec in plan:
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        child = getattr(parent, child_name)
        if spec.partition_type == "row":
            layer = LinearAllreduce(child, tp_group, name=name)
        else:
            layer = LinearLayer(child, tp_group, gather_output=spec.gather_output, name=name)
        setattr(parent, child_name, layer)
    logger.info("AutoTP (partition_config): %d linears split over %d ranks", len(plan), world)
    model.ds_autotp_parsed = True
    return model
