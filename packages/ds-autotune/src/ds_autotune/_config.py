"""The ``autotuning`` section of a DeepSpeed config, checked key by key (standard library only).

Keys and defaults are DeepSpeed's documented ones (the config reference); a key nobody knows or a
value of the wrong kind is a `ValueError` naming the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

METRICS = ("throughput", "latency", "flops")
TUNERS = ("gridsearch", "random", "model_based")
MODEL_INFO_KEYS = ("profile", "num_params", "hidden_size", "num_layers")
# the key each metric is read from in the metric file (DeepSpeed's engine writes FLOPS under FLOPS_per_gpu)
METRIC_FILE_KEYS = {"throughput": "throughput", "latency": "latency", "flops": "FLOPS_per_gpu"}


@dataclasses.dataclass(frozen=True)
class AutotuningConfig:
    """DeepSpeed's ``autotuning`` section. Build it with `AutotuningConfig.from_dict`."""

    enabled: bool = False
    fast: bool = True
    results_dir: str = "autotuning_results"
    exps_dir: str = "autotuning_exps"
    overwrite: bool = False
    start_profile_step: int = 3
    end_profile_step: int = 5
    metric_path: str | None = None
    model_info_path: str | None = None
    metric: str = "throughput"
    tuner_type: str = "model_based"
    tuner_early_stopping: int = 5
    tuner_num_trials: int = 50
    arg_mappings: dict | None = None
    model_info: dict | None = None
    mp_size: int = 1
    max_train_batch_size: int | None = None
    min_train_batch_size: int = 1
    max_train_micro_batch_size_per_gpu: int = 1024
    min_train_micro_batch_size_per_gpu: int = 1
    num_tuning_micro_batch_sizes: int = 3
    num_nodes: int | None = None
    num_gpus: int | None = None

    @classmethod
    def from_dict(cls, section: Mapping | None) -> AutotuningConfig:
        """The section from its dict (None or absent: every default); unknown keys and bad values raise."""
        if section is None:
            return cls()
        if not isinstance(section, Mapping):
            raise ValueError(f"autotuning must be a JSON object (dict), got {section!r}")
        names = [f.name for f in dataclasses.fields(cls)]
        for key in section:
            if key not in names:
                close = difflib.get_close_matches(str(key), names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"autotuning.{key} is not a key of the autotuning section{hint} "
                                 f"(allowed: {', '.join(names)})")
        # the features page shows results_dir/exps_dir null: the default directory
        values = {k: _check(k, v) for k, v in section.items()
                  if not (k in ("results_dir", "exps_dir") and v is None)}
        out = cls(**values)
        if out.end_profile_step < out.start_profile_step:
            raise ValueError(f"autotuning.end_profile_step {out.end_profile_step} must not be less than "
                             f"start_profile_step {out.start_profile_step}")
        if out.min_train_micro_batch_size_per_gpu > out.max_train_micro_batch_size_per_gpu:
            raise ValueError(f"autotuning.min_train_micro_batch_size_per_gpu {out.min_train_micro_batch_size_per_gpu}"
                             f" must not exceed max_train_micro_batch_size_per_gpu "
                             f"{out.max_train_micro_batch_size_per_gpu}")
        return out

    @property
    def metric_key(self) -> str:
        """The key of the metric file this config's ``metric`` is read from."""
        return METRIC_FILE_KEYS[self.metric]

    @property
    def higher_is_better(self) -> bool:
        return self.metric != "latency"


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"autotuning.{key} must be true or false, got {value!r}")
    return value


def _int(key: str, value: Any, low: int, none: bool = False) -> int | None:
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        allowed = f"an integer >= {low}" + (" or null" if none else "")
        raise ValueError(f"autotuning.{key} must be {allowed}, got {value!r}")
    return value


def _path(key: str, value: Any, none: bool) -> str | None:
    if value is None and none:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"autotuning.{key} must be a non-empty path string{' or null' if none else ''}, "
                         f"got {value!r}")
    return value


def _choice(key: str, value: Any, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value.lower() not in allowed:
        raise ValueError(f"autotuning.{key} must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}")
    return value.lower()


def _model_info(value: Any) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"autotuning.model_info must be an object with keys {', '.join(MODEL_INFO_KEYS)}, "
                         f"got {value!r}")
    out = {}
    for key, item in value.items():
        if key not in MODEL_INFO_KEYS:
            raise ValueError(f"autotuning.model_info.{key} is not a model_info key (allowed: "
                             f"{', '.join(MODEL_INFO_KEYS)})")
        out[key] = _bool("model_info.profile", item) if key == "profile" else \
            _int(f"model_info.{key}", item, 1, none=True)
    return out


def _arg_mappings(value: Any) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str) and v.startswith("-")
                                                 for k, v in value.items()):
        raise ValueError("autotuning.arg_mappings must map config keys to the script's options, e.g. "
                         f'{{"train_micro_batch_size_per_gpu": "--batch_size"}}, got {value!r}')
    return dict(value)


def _check(key: str, value: Any) -> Any:
    if key in ("enabled", "fast", "overwrite"):
        return _bool(key, value)
    if key in ("results_dir", "exps_dir"):
        return _path(key, value, none=False)
    if key in ("metric_path", "model_info_path"):
        return _path(key, value, none=True)
    if key == "metric":
        return _choice(key, value, METRICS)
    if key == "tuner_type":
        return _choice(key, value, TUNERS)
    if key in ("start_profile_step", "end_profile_step", "tuner_early_stopping"):
        return _int(key, value, 0)
    if key in ("tuner_num_trials", "mp_size", "min_train_batch_size", "max_train_micro_batch_size_per_gpu",
               "min_train_micro_batch_size_per_gpu", "num_tuning_micro_batch_sizes"):
        return _int(key, value, 1)
    if key in ("max_train_batch_size", "num_nodes", "num_gpus"):
        return _int(key, value, 1, none=True)
    if key == "model_info":
        return _model_info(value)
    if key == "arg_mappings":
        return _arg_mappings(value)
    raise AssertionError(key)  # from_dict checked the name
