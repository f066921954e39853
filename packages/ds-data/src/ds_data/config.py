"""The config sections of ds-data, key for key as DeepSpeed names them.

``curriculum_learning`` (the top-level, sequence-length curriculum DeepSpeed calls "legacy") is
`CurriculumLearningConfig`; its ``schedule_config`` is `ScheduleConfig`. ``progressive_layer_drop`` is
`ProgressiveLayerDropConfig`. ``data_efficiency`` is `DataEfficiencyConfig` (``data_sampling``:
`DataSamplingConfig`, its curriculum metrics and dynamic batching; ``data_routing.random_ltd``:
`RandomLTDConfig`). A section that is off may leave its keys out; one that is on must give
what its schedule needs, and every value given is checked whether the section is on or off.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from ds_config import Section
from pydantic import Field, field_validator, model_validator

CURRICULUM = "curriculum_learning"
PLD = "progressive_layer_drop"
SCHEDULE_TYPES = ("fixed_linear", "fixed_root", "fixed_discrete", "custom")
CURRICULUM_TYPES = ("seqlen",)


def _choice(value: str, key: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{key} must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}")
    return value


class ScheduleConfig(Section):
    """The ``schedule_config`` of a curriculum: which keys a schedule reads depends on its ``schedule_type``
    (``fixed_linear``: total_curriculum_step, difficulty_step; ``fixed_root``: those and root_degree;
    ``fixed_discrete``: difficulty, max_step; ``custom``: none)."""

    total_curriculum_step: int | None = Field(
        None, description="fixed_linear/fixed_root: the step at which the difficulty reaches max_difficulty.")
    difficulty_step: int | None = Field(
        None, description="fixed_linear/fixed_root: every difficulty is rounded down to a multiple of this "
        "(a multiple of 8 keeps fp16 sequence lengths Tensor-Core friendly; DeepSpeed warns otherwise).")
    root_degree: int | float | None = Field(
        None, description="fixed_root: the degree of the root (2: square root; 1 is fixed_linear).")
    difficulty: list[int] | None = Field(
        None, description="fixed_discrete: the difficulties in order (one more than max_step).")
    max_step: list[int] | None = Field(
        None, description="fixed_discrete: the last step of each difficulty but the last, increasing.")

    @field_validator("total_curriculum_step", "difficulty_step")
    @classmethod
    def _positive(cls, value: int | None, info) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"schedule_config.{info.field_name} must be a positive integer, got {value}")
        return value

    @field_validator("root_degree")
    @classmethod
    def _degree(cls, value: int | float | None) -> int | float | None:
        if value is not None and (isinstance(value, bool) or not math.isfinite(value) or value <= 0):
            raise ValueError(f"schedule_config.root_degree must be a number > 0, got {value!r}")
        return value

    @field_validator("difficulty", "max_step")
    @classmethod
    def _not_empty(cls, value: list[int] | None, info) -> list[int] | None:
        if value is not None and not value:
            raise ValueError(f"schedule_config.{info.field_name} must not be empty, got []")
        return value

    @field_validator("max_step")
    @classmethod
    def _increasing(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(b <= a for a, b in itertools.pairwise(value)):
            raise ValueError(f"schedule_config.max_step must be increasing (the last step of each difficulty), "
                             f"got {value}")
        return value

    def given(self) -> dict[str, Any]:
        """The keys given, as a plain dict (DeepSpeed's ``schedule_config``)."""
        return {key: value for key, value in self.model_dump().items() if value is not None}


class CurriculumLearningConfig(Section):
    """The top-level ``curriculum_learning`` section (DeepSpeed's legacy sequence-length curriculum): while
    it is on, the engine passes ``curriculum_seqlen=<the current difficulty>`` to the model's forward."""

    section = CURRICULUM

    enabled: bool = Field(False, description="Schedule the sequence length and pass it to the model's forward.")
    curriculum_type: str = Field("seqlen", description="What the difficulty is: \"seqlen\", the sequence length "
                                 "the engine passes as curriculum_seqlen (the only type DeepSpeed acts on).")
    min_difficulty: int | None = Field(None, description="The difficulty at step 0 (required when enabled).")
    max_difficulty: int | None = Field(None, description="The difficulty the schedule ends at (required when "
                                       "enabled); once reached it no longer changes.")
    schedule_type: str | None = Field(None, description="fixed_linear, fixed_root, fixed_discrete or custom "
                                      "(required when enabled).")
    schedule_config: ScheduleConfig = Field(default_factory=ScheduleConfig,
                                            description="The schedule's parameters (see ScheduleConfig).")

    @field_validator("curriculum_type")
    @classmethod
    def _type(cls, value: str) -> str:
        return _choice(value, f"{CURRICULUM}.curriculum_type", CURRICULUM_TYPES)

    @field_validator("schedule_type")
    @classmethod
    def _schedule(cls, value: str | None) -> str | None:
        return None if value is None else _choice(value, f"{CURRICULUM}.schedule_type", SCHEDULE_TYPES)

    @field_validator("min_difficulty", "max_difficulty")
    @classmethod
    def _difficulty(cls, value: int | None, info) -> int | None:
        if value is not None and value < 0:
            raise ValueError(f"{CURRICULUM}.{info.field_name} must be >= 0, got {value}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> CurriculumLearningConfig:
        low, high = self.min_difficulty, self.max_difficulty
        if low is not None and high is not None and low > high:
            raise ValueError(f"{CURRICULUM}.min_difficulty {low} is above max_difficulty {high}")
        if self.enabled:
            self.check_complete()
        return self

    def check_complete(self) -> None:
        """Raise a `ValueError` naming each key the schedule needs and was not given, or a
        fixed_discrete schedule whose lists do not pair up."""
        missing = [key for key in ("min_difficulty", "max_difficulty", "schedule_type") if getattr(self, key) is None]
        schedule, kind = self.schedule_config, self.schedule_type
        needs = {"fixed_linear": ("total_curriculum_step", "difficulty_step"),
                 "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
                 "fixed_discrete": ("difficulty", "max_step")}.get(kind or "", ())
        missing += [f"schedule_config.{key}" for key in needs if getattr(schedule, key) is None]
        if missing:
            why = f" (schedule_type {kind!r} needs them)" if any("." in m for m in missing) else ""
            raise ValueError(f"{CURRICULUM} needs {', '.join(missing)}{why}")
        if kind == "fixed_discrete" and len(schedule.difficulty) != len(schedule.max_step) + 1:
            raise ValueError(f"{CURRICULUM}.schedule_config.difficulty must have one more entry than max_step (the "
                             f"last difficulty holds after the last max_step), got {len(schedule.difficulty)} "
                             f"difficulties and {len(schedule.max_step)} max_step entries")

    def params(self) -> dict[str, Any]:
        """The section without ``enabled``, as DeepSpeed's ``curriculum_params_legacy()`` returns it."""
        out: dict[str, Any] = {"curriculum_type": self.curriculum_type}
        for key in ("min_difficulty", "max_difficulty", "schedule_type"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        out["schedule_config"] = self.schedule_config.given()
        return out


class ProgressiveLayerDropConfig(Section):
    """The ``progressive_layer_drop`` section: while it is on, the engine passes
    ``progressive_layer_drop=True, pld_theta=θ(step)`` to the model's forward in training."""

    section = PLD

    enabled: bool = Field(False, description="Compute the keep ratio theta each step and pass it to forward.")
    theta: float = Field(1.0, description="The keep ratio theta converges to, in [0, 1] (DeepSpeed's default "
                         "1.0 drops nothing; the PLD paper uses 0.5).")
    gamma: float = Field(0.001, description="How fast theta falls from 1 to its final value: "
                         "theta(t) = (1 - theta) * exp(-gamma * t) + theta; >= 0.")

    @field_validator("theta")
    @classmethod
    def _theta(cls, value: float) -> float:
        if not (0.0 <= value <= 1.0):  # 0 is DeepSpeed's too: every block's keep probability falls towards 1 - (i+1)/L
            raise ValueError(f"{PLD}.theta must be in [0, 1] (the final keep ratio), got {value!r}")
        return float(value)

    @field_validator("gamma")
    @classmethod
    def _gamma(cls, value: float) -> float:
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{PLD}.gamma must be a number >= 0, got {value!r}")
        return float(value)

    def params(self) -> dict[str, float]:
        """The section without ``enabled``, as DeepSpeed's ``pld_params()`` returns it."""
        return {"theta": self.theta, "gamma": self.gamma}


# ------------------------------------------------------------------------------------------------ data_efficiency
DATA_EFFICIENCY = "data_efficiency"
RANDOM_LTD = f"{DATA_EFFICIENCY}.data_routing.random_ltd"
SAMPLING = f"{DATA_EFFICIENCY}.data_sampling"


def _positive(value: int | None, key: str) -> int | None:
    if value is not None and value < 1:
        raise ValueError(f"{key} must be a positive integer, got {value}")
    return value


class RandomLTDScheduleParams(Section):
    """``random_ltd_schedule.schedule_config``."""

    require_steps: int | None = Field(None, description="The step at which the schedule reaches max_value.")
    seq_per_step: int | None = Field(None, description="Every kept length is rounded down to a multiple of this "
                                     "(8 for fp16, 16 for int8 Tensor Cores).")

    @field_validator("require_steps", "seq_per_step")
    @classmethod
    def _positive(cls, value: int | None, info) -> int | None:
        return _positive(value, f"{RANDOM_LTD}.random_ltd_schedule.schedule_config.{info.field_name}")


class RandomLTDScheduleConfig(Section):
    """``random_ltd_schedule``: the number of tokens each random-LTD layer keeps, from ``min_value`` at step 0
    to ``max_value`` (DeepSpeed has one schedule, ``fixed_linear``)."""

    min_value: int | None = Field(None, description="The tokens kept per layer at step 0.")
    max_value: int | None = Field(None, description="The tokens kept once the schedule ends (usually the "
                                  "sequence length: no token dropped).")
    schedule_type: str | None = Field(None, description="\"fixed_linear\" (the only schedule DeepSpeed has).")
    schedule_config: RandomLTDScheduleParams = Field(default_factory=RandomLTDScheduleParams,
                                                     description="require_steps and seq_per_step.")

    @field_validator("min_value", "max_value")
    @classmethod
    def _length(cls, value: int | None, info) -> int | None:
        return _positive(value, f"{RANDOM_LTD}.random_ltd_schedule.{info.field_name}")

    @field_validator("schedule_type")
    @classmethod
    def _type(cls, value: str | None) -> str | None:
        return None if value is None else _choice(value, f"{RANDOM_LTD}.random_ltd_schedule.schedule_type",
                                                  ("fixed_linear",))

    @model_validator(mode="after")
    def _ordered(self) -> RandomLTDScheduleConfig:
        if self.min_value is not None and self.max_value is not None and self.min_value > self.max_value:
            raise ValueError(f"{RANDOM_LTD}.random_ltd_schedule.min_value {self.min_value} is above max_value "
                             f"{self.max_value}")
        return self


class LayerTokenLRScheduleConfig(Section):
    """``layer_token_lr_schedule``: a learning rate by layer-tokens consumed (DeepSpeed refuses it when on:
    "work in progress"; so does ds)."""

    enabled: bool = Field(False, description="Refused when true, as in DeepSpeed.")
    total_layer_tokens: int | None = Field(None, description="Layer-tokens of the whole run (unused).")
    warmup_type: str | None = Field(None, description="The warmup's shape (unused).")
    warmup_layer_tokens: int | None = Field(None, description="Layer-tokens of the warmup (unused).")


class RandomLTDConfig(Section):
    """``data_efficiency.data_routing.random_ltd``: random layerwise token dropping (Yao et al., 2022). The
    layers ``random_ltd_layer_id`` (indices into the model's ``total_layer_num`` converted layers) each run on
    a random subset of the tokens, of the length ``random_ltd_schedule`` gives at each step."""

    enabled: bool = Field(False, description="Drop tokens in the chosen layers while training.")
    total_layer_num: int | None = Field(None, description="The model's number of layers (required when on).")
    random_ltd_layer_num: int | None = Field(None, description="How many layers drop tokens: the length of "
                                             "random_ltd_layer_id (required when on).")
    random_ltd_layer_id: list[int] | None = Field(None, description="Which layers drop tokens, as indices in "
                                                  "[0, total_layer_num) (required when on).")
    model_mask_name: str | None = Field(None, description="The keyword of the layer's attention mask, sliced to "
                                        "the kept tokens (null: the layer gets no mask).")
    model_type: str | None = Field(None, description="\"decoder\" or \"encoder\" (required when on; both are "
                                   "handled by gathering the mask at the kept tokens).")
    hidden_state_order: str | None = Field(None, description="\"batch_seq_dim\" ([batch, seq, hidden]) or "
                                           "\"seq_batch_dim\" ([seq, batch, hidden]) (required when on).")
    random_ltd_schedule: RandomLTDScheduleConfig = Field(default_factory=RandomLTDScheduleConfig,
                                                         description="The kept length's schedule.")
    layer_token_lr_schedule: LayerTokenLRScheduleConfig = Field(
        default_factory=LayerTokenLRScheduleConfig, description="Refused when on (as in DeepSpeed).")

    @field_validator("total_layer_num", "random_ltd_layer_num")
    @classmethod
    def _count(cls, value: int | None, info) -> int | None:
        return _positive(value, f"{RANDOM_LTD}.{info.field_name}")

    @field_validator("model_type")
    @classmethod
    def _model_type(cls, value: str | None) -> str | None:
        return None if value is None else _choice(value, f"{RANDOM_LTD}.model_type", ("decoder", "encoder"))

    @field_validator("hidden_state_order")
    @classmethod
    def _order(cls, value: str | None) -> str | None:
        return None if value is None else _choice(value, f"{RANDOM_LTD}.hidden_state_order",
                                                  ("batch_seq_dim", "seq_batch_dim"))

    @model_validator(mode="after")
    def _consistent(self) -> RandomLTDConfig:
        ids, total, num = self.random_ltd_layer_id, self.total_layer_num, self.random_ltd_layer_num
        if ids is not None:
            if any(i < 0 for i in ids):
                raise ValueError(f"{RANDOM_LTD}.random_ltd_layer_id must hold layer indices >= 0, got {ids}")
            if len(set(ids)) != len(ids):
                raise ValueError(f"{RANDOM_LTD}.random_ltd_layer_id has repeated layers: {ids}")
            if total is not None and any(not 0 <= i < total for i in ids):
                bad = [i for i in ids if not 0 <= i < total]
                raise ValueError(f"{RANDOM_LTD}.random_ltd_layer_id {bad} out of range: layers are 0 to "
                                 f"total_layer_num - 1 = {total - 1}")
            if num is not None and num != len(ids):
                raise ValueError(f"{RANDOM_LTD}.random_ltd_layer_num {num} must equal the length of "
                                 f"random_ltd_layer_id ({len(ids)})")
        if num is not None and total is not None and num > total:
            raise ValueError(f"{RANDOM_LTD}.random_ltd_layer_num {num} is above total_layer_num {total}")
        if self.enabled:
            self.check_complete()
        return self

    def check_complete(self) -> None:
        """Raise a `ValueError` naming each key random-LTD needs and was not given."""
        schedule = self.random_ltd_schedule
        missing = [key for key in ("total_layer_num", "random_ltd_layer_num", "random_ltd_layer_id", "model_type",
                                   "hidden_state_order") if getattr(self, key) is None]
        missing += [f"random_ltd_schedule.{key}" for key in ("min_value", "max_value", "schedule_type")
                    if getattr(schedule, key) is None]
        missing += [f"random_ltd_schedule.schedule_config.{key}" for key in ("require_steps", "seq_per_step")
                    if getattr(schedule.schedule_config, key) is None]
        if missing:
            raise ValueError(f"{RANDOM_LTD} is enabled and needs {', '.join(missing)}")


class DataRoutingConfig(Section):
    """``data_efficiency.data_routing``."""

    enabled: bool = Field(False, description="DeepSpeed reads it and acts on random_ltd.enabled alone; so does ds.")
    random_ltd: RandomLTDConfig = Field(default_factory=RandomLTDConfig, description="Random-LTD.")


class CurriculumMetricConfig(Section):
    """One entry of ``curriculum_metrics``: a metric's index files (written by the data analyzer) and its
    difficulty schedule (the keys of `CurriculumScheduler`)."""

    index_to_sample_path: str | None = Field(None, description="The analyzer's index_to_sample file of the metric.")
    index_to_metric_path: str | None = Field(None, description="The analyzer's index_to_metric file (needed by "
                                             "difficulty_type value).")
    difficulty_type: str | None = Field(None, description="\"value\" (difficulties are metric values) or "
                                        "\"percentile\" (percentiles of the metric, 0 to 100).")
    clustering_type: str | None = Field(None, description="\"schedule_based\" (samples clustered by the schedule's "
                                        "difficulty) or \"single_cluster\" (no clustering).")
    min_difficulty: int | None = Field(None, description="The difficulty at step 0.")
    max_difficulty: int | None = Field(None, description="The difficulty the schedule ends at.")
    schedule_type: str | None = Field(None, description="fixed_linear, fixed_root, fixed_discrete or custom.")
    schedule_config: ScheduleConfig = Field(default_factory=ScheduleConfig, description="The schedule's parameters.")

    @field_validator("difficulty_type")
    @classmethod
    def _difficulty_type(cls, value: str | None) -> str | None:
        return None if value is None else _choice(value, "difficulty_type", ("value", "percentile"))

    @field_validator("clustering_type")
    @classmethod
    def _clustering(cls, value: str | None) -> str | None:
        return None if value is None else _choice(value, "clustering_type", ("schedule_based", "single_cluster"))

    @field_validator("schedule_type")
    @classmethod
    def _schedule(cls, value: str | None) -> str | None:
        return None if value is None else _choice(value, "schedule_type", SCHEDULE_TYPES)

    @model_validator(mode="after")
    def _consistent(self) -> CurriculumMetricConfig:
        low, high = self.min_difficulty, self.max_difficulty
        if low is not None and high is not None and low > high:
            raise ValueError(f"min_difficulty {low} is above max_difficulty {high}")
        if self.difficulty_type == "percentile":
            bad = [v for v in (low, high) if v is not None and not 0 <= v <= 100]
            if bad:
                raise ValueError(f"difficulty_type 'percentile' needs min_difficulty and max_difficulty in "
                                 f"[0, 100], got {bad[0]}")
        return self

    def check_complete(self, name: str) -> None:
        """Raise a `ValueError` naming each key metric ``name`` needs and was not given."""
        missing = [key for key in ("difficulty_type", "clustering_type") if getattr(self, key) is None]
        if self.clustering_type == "schedule_based":
            missing += ["index_to_sample_path"] if self.index_to_sample_path is None else []
            if self.difficulty_type == "value" and self.index_to_metric_path is None:
                missing.append("index_to_metric_path")
        if missing:
            raise ValueError(f"{SAMPLING}.curriculum_learning.curriculum_metrics.{name} needs {', '.join(missing)}")
        try:
            self.schedule().check_complete()
        except ValueError as e:
            raise ValueError(f"{SAMPLING}.curriculum_learning.curriculum_metrics.{name}: "
                             f"{str(e).removeprefix(CURRICULUM + ' ')}") from None

    def schedule(self) -> CurriculumLearningConfig:
        """The metric's schedule as the section `CurriculumScheduler` takes."""
        return CurriculumLearningConfig(min_difficulty=self.min_difficulty, max_difficulty=self.max_difficulty,
                                        schedule_type=self.schedule_type, schedule_config=self.schedule_config)


class DataCurriculumConfig(Section):
    """``data_efficiency.data_sampling.curriculum_learning``: sampling by difficulty, one schedule per metric."""

    enabled: bool = Field(False, description="Draw each batch from the difficulties the schedules allow.")
    data_cluster_path: str | None = Field(None, description="The directory of the difficulty clusters (needed by "
                                          "schedule_based metrics).")
    curriculum_metrics: dict[str, CurriculumMetricConfig] = Field(
        default_factory=dict, description="Metric name -> its index files and schedule (required when on).")

    @model_validator(mode="after")
    def _consistent(self) -> DataCurriculumConfig:
        if self.enabled:
            if not self.curriculum_metrics:
                raise ValueError(f"{SAMPLING}.curriculum_learning is enabled and needs curriculum_metrics")
            for name, metric in self.curriculum_metrics.items():
                metric.check_complete(name)
            if self.data_cluster_path is None and any(
                    m.clustering_type == "schedule_based" for m in self.curriculum_metrics.values()):
                raise ValueError(f"{SAMPLING}.curriculum_learning needs data_cluster_path (a schedule_based metric "
                                 "clusters its samples there)")
        return self


class DynamicBatchingConfig(Section):
    """``data_efficiency.data_sampling.dynamic_batching``: batches built by token count, the learning rate
    scaled per batch."""

    enabled: bool = Field(False, description="Build batches of up to max_tokens tokens.")
    metrics_path: str | None = Field(None, description="The analyzer's sequence-length metric files.")
    lr_scaling_method: str = Field("linear", description="\"linear\", \"sqrt\" or \"none\".")
    min_batch_size: int = Field(1, description="The fewest samples in a batch.")
    max_batch_size: int | None = Field(None, description="The most samples in a batch (null: no limit).")
    sequence_picking_order: str = Field("dataloader", description="\"dataloader\", \"random\" or \"seqlen\".")
    max_tokens: int | None = Field(None, description="Tokens per batch (required when on).")
    verbose: bool = Field(False, description="Log each batch's composition.")

    @field_validator("lr_scaling_method")
    @classmethod
    def _scaling(cls, value: str) -> str:
        return _choice(value, f"{SAMPLING}.dynamic_batching.lr_scaling_method", ("linear", "sqrt", "none"))

    @field_validator("sequence_picking_order")
    @classmethod
    def _order(cls, value: str) -> str:
        return _choice(value, f"{SAMPLING}.dynamic_batching.sequence_picking_order",
                       ("dataloader", "random", "seqlen"))

    @field_validator("min_batch_size", "max_batch_size", "max_tokens")
    @classmethod
    def _sizes(cls, value: int | None, info) -> int | None:
        return _positive(value, f"{SAMPLING}.dynamic_batching.{info.field_name}")

    @model_validator(mode="after")
    def _consistent(self) -> DynamicBatchingConfig:
        if self.max_batch_size is not None and self.max_batch_size < self.min_batch_size:
            raise ValueError(f"{SAMPLING}.dynamic_batching.max_batch_size {self.max_batch_size} is below "
                             f"min_batch_size {self.min_batch_size}")
        if self.enabled and self.max_tokens is None:
            raise ValueError(f"{SAMPLING}.dynamic_batching is enabled and needs max_tokens")
        return self


class DataSamplingConfig(Section):
    """``data_efficiency.data_sampling``."""

    enabled: bool = Field(False, description="Sample the training data by difficulty.")
    num_epochs: int = Field(1000, description="At most this many passes over the dataset.")
    num_workers: int = Field(0, description="Data loader workers.")
    pin_memory: bool = Field(False, description="The data loader pins its batches.")
    curriculum_learning: DataCurriculumConfig = Field(default_factory=DataCurriculumConfig,
                                                      description="Difficulty-based sampling.")
    dynamic_batching: DynamicBatchingConfig = Field(default_factory=DynamicBatchingConfig,
                                                    description="Token-count batches and per-batch LR scaling.")

    @field_validator("num_epochs")
    @classmethod
    def _epochs(cls, value: int) -> int:
        return _positive(value, f"{SAMPLING}.num_epochs")

    @field_validator("num_workers")
    @classmethod
    def _workers(cls, value: int) -> int:
        if value < 0:
            raise ValueError(f"{SAMPLING}.num_workers must be >= 0, got {value}")
        return value


class DataEfficiencyConfig(Section):
    """The ``data_efficiency`` section (DeepSpeed's data efficiency library): ``data_sampling`` (curriculum
    learning by difficulty metrics, dynamic batching) and ``data_routing`` (random-LTD)."""

    section = DATA_EFFICIENCY

    enabled: bool = Field(False, description="DeepSpeed's switch of the library (its data sampler needs it).")
    seed: int = Field(1234, description="The seed of the data sampler's random draws.")
    data_sampling: DataSamplingConfig = Field(default_factory=DataSamplingConfig, description="Data sampling.")
    data_routing: DataRoutingConfig = Field(default_factory=DataRoutingConfig, description="Data routing.")
