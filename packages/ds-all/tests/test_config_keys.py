"""Every key of DeepSpeed's config reference (shared/seeds, the "DeepSpeed Configuration JSON" page) and of
DeepSpeed 0.19's config models is known to `ds_all.Config`: it is implemented, accepted as a documented no-op
(a row of a README's "Differences from DeepSpeed" table), or refused by name because the feature is not
built. None is ever an "unknown key"."""

from __future__ import annotations

import json
import re
import typing
from pathlib import Path

import pytest
from ds_config import DEEPSPEED_KEYS
from ds_config._section import _members
from pydantic import BaseModel

import ds_all
from ds_all import Config
from ds_all.config import NOT_IMPLEMENTED

HERE = Path(__file__).parent
REPO = HERE.parents[2]
REFERENCE_NAMES = HERE / "fixtures" / "deepspeed_reference_keys.json"
SEEDS = REPO.parent / "shared" / "seeds"

# Keys of the reference that live inside a section ds-all does not implement (accepted while the section is off,
# refused by the section's name when on), or are deprecated spellings mapped to their replacement.
IN_UNBUILT_SECTIONS = {
    "comet": ["enabled", "samples_log_interval", "project", "workspace", "api_key", "experiment_name",
              "experiment_key", "online", "mode"],
    "amp": ["enabled", "opt_level"],
}
DEPRECATED = {"cpu_offload": "zero_optimization", "cpu_offload_param": "zero_optimization",
              "cpu_offload_use_pin_memory": "zero_optimization"}

# Accepted, with no effect in ds: each is named in a "Differences from DeepSpeed" table with the reason.
NO_OP = [
    "prescale_gradients", "gradient_predivide_factor", "use_data_before_expert_parallelism",
    "zero_optimization.contiguous_gradients", "zero_optimization.reduce_scatter", "zero_optimization.overlap_comm",
    "zero_optimization.compute_grad_norm", "zero_optimization.grad_hooks",
    "zero_optimization.use_multi_rank_bucket_allreduce", "zero_optimization.allgather_partitions",
    "zero_optimization.allgather_bucket_size", "zero_optimization.round_robin_gradients",
    "zero_optimization.load_from_fp32_weights", "zero_optimization.elastic_checkpoint",
    "zero_optimization.offload_optimizer.pin_memory", "zero_optimization.offload_optimizer.buffer_count",
    "zero_optimization.offload_optimizer.fast_init", "zero_optimization.offload_optimizer.cpuadam_cores_perc",
    "zero_optimization.offload_param.pin_memory", "zero_optimization.offload_param.buffer_count",
    "zero_optimization.zenflow.auto_ratio", "zero_optimization.zenflow.pt_reserved_cores_perc",
    "zero_optimization.offload_param.buffer_size", "zero_optimization.offload_param.max_in_cpu",
    "zero_optimization.stage3_module_granularity_threshold", "zero_optimization.stage3_use_all_reduce_for_fetch_params",
    "zero_optimization.stage3_allgather_sequential", "zero_optimization.parameter_alignment",
    "zero_optimization.enable_sanity_checks", "zero_optimization.save_muon_momentum_buffer_in_memory",
    "zero_optimization.memory_efficient_linear",
    "zero_optimization.pipeline_loading_checkpoint", "zero_optimization.override_module_apply",
    "zero_optimization.log_trace_cache_warnings", "bf16.immediate_grad_update",
    "pipeline.use_reentrant",
    # DeepSpeed's engine reads neither (its sampler runs on curriculum_learning.enabled; pin_memory is its dynamic
    # batching's); ds keeps its clusters in memory
    "data_efficiency.data_sampling.enabled", "data_efficiency.data_sampling.pin_memory",
    "data_efficiency.data_sampling.curriculum_learning.data_cluster_path",
    "checkpoint.load_universal", "checkpoint.parallel_write.pipeline_stage",
    "data_types.grad_accum_dtype", "data_types.buffer_dtype", "data_types.keep_in_fp32_modules",
    "torch_autocast.lower_precision_safe_modules",
]
# Refused by name when turned on: (value that turns it on, where it is refused).
REFUSED = {
    "tensor_parallel.tp_overlap_comm": (True, "config"), "tensor_parallel.tp.tp_grain_size": (2, "config"),
    "tensor_parallel.keep_module_on_host": (True, "config"), "gradient_allreduce_op": ("sum", "config"),
    "managed_gradient_accumulation": (False, "config"), "compile.deepcompile": (True, "config"),
    "zero_optimization.mics_shard_size": (2, "ds-zero"),
    "zero_optimization.mics_hierarchical_params_gather": (True, "ds-zero"),
    "zero_optimization.legacy_stage1": (True, "ds-zero"),
    "zero_optimization.offload_optimizer.super_offload": (True, "ds-zero"),
    "zero_optimization.offload_optimizer.ratio": (0.5, "ds-zero"),
    "fp16.fp16_master_weights_and_grads": (True, "ds-zero"),
    "data_efficiency.data_routing.random_ltd.layer_token_lr_schedule.enabled": (True, "ds-data"),
}
# Sections whose keys are read only once the feature they belong to is built (refused on until then, above).
INSIDE_REFUSED = ("data_efficiency.data_routing.random_ltd.layer_token_lr_schedule.",)
# Keys read inside their section model's own methods (which the source scan below skips with config.py files).
READ_BY_THEIR_MODEL = {"flops_profiler.detailed": "FlopsProfilerConfig.print_options()",
                       "zero_optimization.zenflow.select_strategy": "ZenFlowConfig.selection_interval()"}


def _walk(model: type[BaseModel], prefix: str = "") -> dict[str, type[BaseModel] | None]:
    """Every key path of a section model (dict values' models under "*"), each with its own model if it has one."""
    paths: dict[str, type[BaseModel] | None] = {}
    for name, field in model.model_fields.items():
        path = f"{prefix}.{field.alias or name}" if prefix else field.alias or name
        models = [m for m in _members(field.annotation) if isinstance(m, type) and issubclass(m, BaseModel)]
        paths[path] = models[0] if models else None
        for member in models:
            paths.update(_walk(member, path))
        for member in _members(field.annotation):
            if typing.get_origin(member) is dict:
                for value in _members(typing.get_args(member)[1]):
                    if isinstance(value, type) and issubclass(value, BaseModel):
                        paths.update(_walk(value, f"{path}.*"))
    return paths


PATHS = _walk(Config)
LEAVES = [p for p, model in PATHS.items() if model is None and "*" not in p
          and not p.startswith(("compression_training.", "sparse_attention.", "optimizer.", "scheduler."))]


def _nested(path: str, value) -> dict:
    out: dict = {}
    holder = out
    parts = path.split(".")
    for part in parts[:-1]:
        holder = holder.setdefault(part, {})
    holder[parts[-1]] = value
    return out


def _context(path: str) -> dict:
    """What a key needs around it to be read: stage-3 keys a stage 3, offload keys an offload device."""
    config: dict = {"train_batch_size": 4}
    if path.startswith("zero_optimization."):
        zero: dict = {"stage": 3}
        if ".offload_optimizer." in path:
            zero["offload_optimizer"] = {"device": "cpu"}
        if ".offload_param." in path:
            zero["offload_param"] = {"device": "cpu"}
        config["zero_optimization"] = zero
    if path.startswith("bf16.") or path == "zero_optimization.bf16":
        config["bf16"] = {"enabled": True}
    return config


def _merge(into: dict, extra: dict) -> dict:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value
    return into


def _reference_names() -> list[str]:
    return json.loads(REFERENCE_NAMES.read_text())


def test_the_reference_key_list_is_the_seeds():
    """The fixture is the list of `key: [type]` entries of the config reference in shared/seeds (checked against
    the seeds wherever they are beside the checkout)."""
    names = _reference_names()
    assert len(names) > 150 and names == sorted(set(names))
    if not SEEDS.exists():
        pytest.skip(f"{SEEDS} not beside this checkout: the fixture stands for it")
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted(SEEDS.glob("*.txt")))
    page = max(text.splitlines(), key=lambda line: len(re.findall(r"[A-Za-z0-9_:]+: \[", line)))
    assert sorted(set(re.findall(r"([A-Za-z0-9_:]+): \[", page))) == names


def test_every_key_of_the_reference_is_known():
    fields = {p.rsplit(".", 1)[-1] for p in PATHS} | {p for p in PATHS}
    unknown = []
    for name in _reference_names():
        key = name.replace(":", ".")
        if key in fields or key.rsplit(".", 1)[-1] in fields or key in DEPRECATED or key in NOT_IMPLEMENTED:
            continue
        if any(key in keys for keys in IN_UNBUILT_SECTIONS.values()):
            continue
        unknown.append(name)
    assert unknown == []


@pytest.mark.parametrize("path", LEAVES)
def test_every_key_loads_with_a_value_other_than_its_default(path):
    field_path = path
    config = _context(path)
    default = _default(path)
    value = REFUSED.get(path, (_other(default), ""))[0]
    _merge(config, _nested(field_path, value))
    if path in REFUSED and REFUSED[path][1] == "config":
        with pytest.raises(ValueError) as error:
            Config.load(config)
        assert path.rsplit(".", 1)[-1] in str(error.value) and "unknown key" not in str(error.value)
        return
    try:
        loaded = Config.load(config)
    except ValueError as e:  # a value our example picked may be out of range: never an unknown key
        assert "unknown key" not in str(e), e
        return
    assert _read(loaded, path) is not None or value is None


def _default(path: str):
    holder = Config()
    for part in path.split("."):
        holder = _attribute(holder, part)
    return holder


def _attribute(model, key):
    for name, field in type(model).model_fields.items():
        if key in (name, field.alias):
            value = getattr(model, name)
            return value if value is not None or field.annotation is None else _empty(field)
    raise KeyError(key)


def _empty(field):
    models = [m for m in _members(field.annotation) if isinstance(m, type) and issubclass(m, BaseModel)]
    return models[0]() if models else None


def _read(config: Config, path: str):
    holder = config
    for part in path.split("."):
        holder = _attribute(holder, part)
    return holder


def _other(default):
    """A value unlike the default, of its type (the key's reading is what is tested, not the value's range)."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, float):
        return default / 2 if default else 0.5
    if isinstance(default, str):
        return default
    if isinstance(default, list):
        return default
    return default


@pytest.mark.parametrize("section", sorted(IN_UNBUILT_SECTIONS))
def test_sections_not_built_are_accepted_off_and_refused_by_name_on(section):
    keys = {key: True for key in IN_UNBUILT_SECTIONS[section] if key != "enabled"}
    Config.load({"train_batch_size": 4, section: {"enabled": False, **keys}})
    with pytest.raises(ValueError, match=rf"{section} is a DeepSpeed feature ds-all .* does not implement"):
        Config.load({"train_batch_size": 4, section: {"enabled": True}})


def test_the_keys_deepspeeds_config_tests_expect_are_known():
    config = Config.load({
        "train_batch_size": 4, "gradient_allreduce_op": "Mean", "data_parallel_size": 2, "sequence_parallel_size": 1,
        "torch_autocast": {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": ["torch.nn.Linear"]},
        "tensor_parallel": {"autotp_size": 1, "tp": {"tp_size": 1}},
        "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
        "pipeline": {"use_reentrant": False},
        "zero_optimization": {"stage": 2, "enable_sanity_checks": True, "zero_hpz_partition_size": 1},
    })
    assert (config.gradient_allreduce_op, config.data_parallel_size, config.torch_autocast.dtype) == \
        ("mean", 2, "bfloat16")
    assert config.pipeline.use_reentrant is False and config.zero_optimization.enable_sanity_checks is True
    for data, words in (({"zero_optimization": {"stage": 3, "zenflow": {"topk_ratio": 0.1}}}, None),
                        ({"tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": True}},
                         "tensor_parallel.tp_overlap_comm True (an AutoTP option beyond slicing the linears) is not "
                         "implemented"),
                        ({"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}},
                         "'sum' is not supported with ZeRO stage 3"),
                        ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
                         "bf16_master_weights_and_grads needs zero_optimization.stage 1, 2 or 3")):
        if words is None:
            Config.load(data)  # zenflow at stage 3 is refused when ZeRO is built (ds-zero's test), known here
            continue
        with pytest.raises(ValueError, match=re.escape(words)):
            Config.load(data)


def test_every_new_top_level_key_is_a_deepspeed_key():
    assert {name.split(".")[0] for name in PATHS} - {"seed"} <= DEEPSPEED_KEYS


def test_every_no_op_key_is_a_row_of_a_differences_table():
    tables = ""
    for readme in sorted(REPO.glob("packages/*/README.md")):
        text = readme.read_text(encoding="utf-8")
        for part in re.split(r"\n#+ ", text):
            if part.startswith("Differences from DeepSpeed"):
                tables += part
    assert tables, "no Differences from DeepSpeed table found"
    named = set(re.findall(r"`([^`]+)`", tables))
    named |= {word for item in named for word in re.split(r"[^A-Za-z0-9_.]+", item) if word}

    def in_a_table(path: str) -> bool:  # by any dotted tail of its path: `pin_memory`, `offload_param.pin_memory`
        parts = path.split(".")
        return any(".".join(parts[i:]) in named for i in range(len(parts)))

    missing = [path for path in NO_OP if not in_a_table(path)]
    assert missing == [], missing
    assert set(NO_OP) <= set(PATHS) and set(REFUSED) <= set(PATHS)


def test_every_implemented_key_is_read_by_code():
    """A key neither a no-op nor refused is read somewhere outside the config models (its field name as an
    attribute or a string): a key nothing reads would silently do nothing."""
    sources = [p for p in REPO.glob("packages/*/src/**/*.py") if not p.name.endswith("config.py")]
    text = "\n".join(p.read_text(encoding="utf-8") for p in sources)
    unread = []
    for path in LEAVES:
        if (_no_op(path) or path in REFUSED or path in READ_BY_THEIR_MODEL
                or path.startswith(("tensor_parallel.", "compile.", *INSIDE_REFUSED))):
            continue
        name = _field_name(path)
        if not re.search(rf"\.{name}\b|[\"']{name}[\"']", text):
            unread.append(path)
    assert unread == [], unread


def _no_op(path: str) -> bool:
    return any(path == key or path.startswith(key + ".") for key in NO_OP)


def _field_name(path: str) -> str:
    model: type[BaseModel] = Config
    name = path
    for part in path.split("."):
        for field_name, field in model.model_fields.items():
            if part in (field_name, field.alias):
                name = field_name
                nested = [m for m in _members(field.annotation) if isinstance(m, type) and issubclass(m, BaseModel)]
                model = nested[0] if nested else model
                break
    return name


def test_ds_all_exports_the_config():
    assert ds_all.Config is Config
