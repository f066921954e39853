"""`Section`: the strict pydantic base of every config section model, and its errors."""

from __future__ import annotations

import difflib
import json
import os
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

# DeepSpeed's top-level config keys: a whole config is recognised by them, and a key that is none of
# them but close to a section's name is reported as a misspelling of that section.
DEEPSPEED_KEYS = frozenset(["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer", "scheduler", "communication_data_type", "prescale_gradients", "gradient_predivide_factor", "sparse_gradients", "fp16", "bf16", "amp", "gradient_clipping", "zero_optimization", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "aio", "activation_checkpointing", "flops_profiler", "comms_logger", "tensorboard", "wandb", "csv_monitor", "comet", "autotuning", "elasticity", "sparse_attention", "compression_training", "data_efficiency", "curriculum_learning", "checkpoint", "data_types", "steps_per_print", "wall_clock_breakdown", "dump_state", "memory_breakdown", "disable_allgather", "pipeline", "dataloader_drop_last", "eigenvalue", "progressive_layer_drop", "quantize_training", "timers", "hybrid_engine", "nebula", "seq_parallel_communication_data_type", "graph_harvesting", "use_node_local_storage", "weight_quantization", "zero_quantized_weights", "zero_quantized_gradients", "load_universal_checkpoint", "torch_autocast", "tensor_parallel", "compile", "gradient_allreduce_op", "disable_python_gc", "managed_gradient_accumulation", "log_level", "data_parallel_size", "sequence_parallel_size", "use_data_before_expert_parallelism", "expert_parallel", "datastates_ckpt", "bfloat16"])


class ConfigError(ValueError):
    """A config that does not validate: one ``key.path: problem`` per line.

    ``problems`` holds ``(path, message)`` pairs, ``path`` the dotted key path inside ``section``."""

    def __init__(self, problems: list[tuple[str, str]], section: str = ""):
        self.problems, self.section = problems, section
        lines = []
        for path, message in problems:
            where = ".".join(p for p in (section, path) if p)
            lines.append(message if not where or message.startswith(where) else f"{where}: {message}")
        super().__init__("\n".join(lines))

    def __reduce__(self):
        # what pickle calls: rebuild from the problems, not from the message (a process pool sends a worker's
        # error to its parent pickled, and an error that cannot be unpickled hangs DeepSpeed's test pool)
        return type(self), (self.problems, self.section)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    keys = [key for key, _ in pairs]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:  # DeepSpeed refuses them too; json would silently keep the last one
        raise ValueError(f"duplicate keys in a DeepSpeed config: {', '.join(repr(k) for k in repeated)}")
    return dict(pairs)


def _parse(text: str, where: str) -> Any:
    """JSON, else HJSON (comments, unquoted keys and strings, trailing commas), as DeepSpeed reads
    configs with hjson; an error names the place and shows JSON's message."""
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        json_error = e
    try:
        import hjson
    except ImportError:
        hjson = None
    if hjson is not None:
        try:
            return hjson.loads(text, object_pairs_hook=_no_duplicates)
        except hjson.HjsonDecodeError:
            pass
    e = json_error
    raise ValueError(f"{where}:{e.lineno}:{e.colno}: not valid JSON{'' if hjson is None else ' or HJSON'}: "
                     f"{e.msg}") from None


def load_ds_config(config: Mapping | str | os.PathLike) -> dict:
    """A whole DeepSpeed config: a mapping as it is; a path of a JSON (or HJSON) file; or, as DeepSpeed
    takes it, a string that is no path but a URL-safe base64 encoding of the JSON."""
    if isinstance(config, Mapping):
        return dict(config)
    if not isinstance(config, (str, os.PathLike)):
        raise ValueError(f"a DeepSpeed config is a dict or the path of a JSON file, got {type(config).__name__}")
    where = os.fspath(config)
    if isinstance(config, str) and not os.path.exists(config):
        decoded = _base64_json(config)
        if decoded is not None:
            loaded, where = decoded, "the base64-encoded config"
            if not isinstance(loaded, dict):
                raise ValueError(f"{where}: a DeepSpeed config is a JSON object, got {type(loaded).__name__}")
            return loaded
    try:
        with open(config, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"cannot read the config file {where!r}: {e.strerror}") from None
    loaded = _parse(text, where)
    if not isinstance(loaded, dict):
        raise ValueError(f"{where}: a DeepSpeed config is a JSON object, got {type(loaded).__name__}")
    return loaded


def _base64_json(text: str) -> Any:
    """The JSON object a URL-safe base64 string encodes (DeepSpeed's launcher passes configs so),
    None when ``text`` is not that."""
    import base64
    import binascii

    if not text or len(text) % 4 or not all(c.isalnum() or c in "-_=" for c in text):
        return None
    try:
        decoded = base64.urlsafe_b64decode(text).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    if not decoded.lstrip().startswith("{"):
        return None
    return _parse(decoded, "the base64-encoded config")


def _members(annotation: Any) -> list[Any]:
    """The alternatives of a type: Optional/Union flattened, Annotated unwrapped."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _members(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _members(arg)]
    return [annotation]


def _json_policy(annotation: Any, value: Any) -> Any:
    """The one leniency of ds configs over pydantic's strict mode: ``5e8`` is an integer where only an
    integer fits, the strings "true"/"false" (which DeepSpeed's tools write) and the integers 0 and 1 (which
    DeepSpeed reads as booleans: ``"zero_allow_untested_optimizer": 1``) are booleans where only a boolean
    fits, and a tuple is a list. Everything else is validated strictly."""
    kinds: set[type] = set()
    choices: set[Any] = set()
    items = None
    for member in _members(annotation):
        origin = typing.get_origin(member)
        if origin in (list, tuple, set, frozenset):
            kinds.add(list)
            items = (typing.get_args(member) or (None,))[0]
        elif origin is Literal:
            choices.update(typing.get_args(member))
        elif isinstance(member, type):
            kinds.add(member)
    if isinstance(value, float) and value.is_integer() and int in kinds and float not in kinds:
        return int(value)
    if (isinstance(value, str) and value.lower() in ("true", "false") and bool in kinds and str not in kinds
            and value not in choices):
        return value.lower() == "true"
    if (type(value) is int and value in (0, 1) and bool in kinds and int not in kinds and float not in kinds
            and value not in choices):
        return bool(value)
    if isinstance(value, tuple) and list in kinds:
        value = list(value)
    if isinstance(value, list) and items is not None:
        return [_json_policy(items, item) for item in value]
    return value


def _field_names(model: type[BaseModel]) -> list[str]:
    names = []
    for name, field in model.model_fields.items():
        names += [field.alias] if field.alias and field.alias != name else []
        names.append(name)
    return names


def _field(model: type[BaseModel], key: Any):
    for name, field in model.model_fields.items():
        if key in (name, field.alias):
            return field
    return None


def _walk(model: type[BaseModel], loc: tuple) -> tuple[list[str], type[BaseModel] | None]:
    """The user's key path of an error location (pydantic's union tags dropped), and the model
    that holds the last key."""
    path: list[str] = []
    current: Any = model
    holder = model
    for key in loc:
        options = _members(current) if current is not None else []
        models = [m for m in options if isinstance(m, type) and issubclass(m, BaseModel)]
        mappings = [m for m in options if typing.get_origin(m) is dict]
        sequences = [m for m in options if typing.get_origin(m) in (list, tuple)]
        if isinstance(key, int) and sequences:
            path.append(f"[{key}]")
            current = (typing.get_args(sequences[0]) or (None,))[0]
        elif mappings and isinstance(key, str):
            path.append(key)
            current = typing.get_args(mappings[0])[1]
        elif len(models) == 1 and not any(key == m.__name__ for m in models):
            holder = models[0]
            field = _field(holder, key)
            path.append(str(key))
            current = field.annotation if field is not None else None
        elif any(key == getattr(m, "__name__", None) for m in models):
            current = next(m for m in models if key == m.__name__)  # a union tag naming a model
        elif len(options) > 1 or (current is None and not path):
            continue  # a union tag such as 'int' or "literal['auto']"
        else:
            path.append(str(key))
            current = None
    return path, holder


def _problem(model: type[BaseModel], error: dict) -> tuple[list[str], str]:
    path, holder = _walk(model, error["loc"])
    kind, message, value = error["type"], error["msg"], error.get("input")
    if kind == "extra_forbidden":
        allowed = _field_names(holder)
        close = difflib.get_close_matches(str(path[-1]), allowed, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return path, f"unknown key {path[-1]!r}{hint} Allowed keys: {', '.join(allowed)}"
    if kind == "missing":
        return path, "is required"
    if kind in ("value_error", "assertion_error"):
        return path, message.split(", ", 1)[1] if message.startswith(("Value error, ", "Assertion failed, ")) else message
    if kind == "model_type" or kind == "dict_type":
        return path, f"must be a mapping of its keys (a JSON object), got {type(value).__name__}"
    wanted = {"bool_type": "true or false", "int_type": "an integer", "int_from_float": "an integer",
              "float_type": "a number", "string_type": "a string", "list_type": "a list"}.get(kind)
    if wanted is None:
        wanted = message.removeprefix("Input should be ").removeprefix("Input should ")
    return path, f"must be {wanted}, got {value!r}"


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p).replace(".[", "[")


def _config_error(model: type[Section], exc: ValidationError) -> ConfigError:
    problems: list[tuple[str, str]] = []
    for error in exc.errors():
        path, message = _problem(model, error)
        nested = (error.get("ctx") or {}).get("error")
        if isinstance(nested, ConfigError):  # a nested Section's own __init__ raised: its paths are relative
            problems += [(_join(*path, sub), sub_message) for sub, sub_message in nested.problems]
            continue
        key = _join(*path)
        last = problems[-1] if problems else ("", "")
        if last[0] == key and message.startswith("must be ") and last[1].startswith("must be "):
            # the alternatives of a union: "must be an integer or 'auto', got 'x'"
            problems[-1] = (key, f"{last[1].rsplit(', got ', 1)[0]} or {message.removeprefix('must be ')}")
        else:
            problems.append((key, message))
    return ConfigError(problems, model.section)


class Section(BaseModel):
    """The base of every ds config section model.

    Unknown keys are errors that name the dotted key path and suggest the closest key. Values are
    validated strictly (pydantic's strict mode: no ``"1"`` for 1, no ``1`` for true), with one
    leniency that JSON needs: ``5e8`` where an integer is meant, and the strings ``"true"`` /
    ``"false"`` where a boolean is meant. Models are frozen. ``section`` is the key of the model in
    ds_config.json (empty for models nested inside another).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, validate_default=True,
                              populate_by_name=True)
    section: ClassVar[str] = ""

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise _config_error(type(self), e) from None

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any):
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as e:
            raise _config_error(cls, e) from None

    @model_validator(mode="before")
    @classmethod
    def _apply_json_policy(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for key, value in data.items():
            field = _field(cls, key)
            if field is not None:
                out[key] = _json_policy(field.annotation, value)
        return out

    @classmethod
    def _misspelled_section(cls, keys) -> str | None:
        fields = set(_field_names(cls))
        for key in keys:
            if (key not in DEEPSPEED_KEYS and key not in fields
                    and difflib.get_close_matches(str(key), [cls.section], n=1, cutoff=0.75)):
                return key
        return None

    @classmethod
    def from_ds_config(cls, config: Mapping | str | os.PathLike | None = None):
        """This section of a whole DeepSpeed config (a dict or a JSON file's path); its defaults
        when the config has no such section. A top-level key that is close to this section's name
        but is no DeepSpeed key is reported as a misspelling, not ignored."""
        if not cls.section:
            raise RuntimeError(f"{cls.__name__} is not a top-level section (its `section` is empty)")
        whole = load_ds_config({} if config is None else config)
        if cls.section in whole:
            value = whole[cls.section]
            return cls.model_validate({} if value is None else value)
        misspelled = cls._misspelled_section(whole)
        if misspelled is not None:
            raise ConfigError([("", f"unknown section {misspelled!r}; did you mean {cls.section!r}?")])
        return cls()

    @classmethod
    def from_section_or_ds_config(cls, config: Any = None):
        """An instance as it is; a path as a whole DeepSpeed config file; a dict as a whole config
        when it holds a top-level DeepSpeed key (that is no key of this section) or a misspelling of
        this section's name, else as this section."""
        if isinstance(config, cls):
            return config
        if config is None:
            return cls()
        deepspeed_keys = (DEEPSPEED_KEYS - set(_field_names(cls))) | {cls.section}
        if (isinstance(config, Mapping) and not set(config) & deepspeed_keys
                and cls._misspelled_section(config) is None):
            return cls.model_validate(dict(config))
        return cls.from_ds_config(config)
