"""The one table of DeepSpeed's module paths (``ds_all/_deepspeed_paths.py``): the re-export modules are
generated from it and a hand edit of one fails here; every path and name it lists is a real module holding the
owner's object; and it invents nothing: each path is one of DeepSpeed 0.19.8's (the fixture
``deepspeed_module_tree.json``, extracted once by ``scripts/extract_deepspeed_tree.py``), each name one of that
module's unless the table lists it as ds's addition."""

from __future__ import annotations

import ast
import importlib
import json
import re
import sys
from collections import Counter
from pathlib import Path

import pytest

from ds_all import _compat_gen
from ds_all._deepspeed_paths import DEEPSPEED, SAFE_FUNCTIONS

FIXTURE = Path(__file__).parent / "fixtures" / "deepspeed_module_tree.json"
REFERENCE = json.loads(FIXTURE.read_text())
REFERENCE_MODULES = {path: set(names.split()) for path, names in REFERENCE["modules"].items()}


def _resolve(owner: str) -> object:
    module, _, attr = owner.partition(":")
    found = importlib.import_module(module)
    return getattr(found, attr) if attr else found


# (path, name, owner) for every name the table gives an owner; (path, name, None) for a hand module's own names
CASES = [(path, name, owner) for path, module in DEEPSPEED.items() for name, owner in module.names.items()]
CASES += [(path, name, None) for path, module in DEEPSPEED.items() for name in module.provides.split()]


def test_the_generated_modules_are_what_the_table_gives():
    assert _compat_gen.drift() == []


def test_a_hand_edit_of_a_generated_module_is_drift_naming_the_file(tmp_path):
    files = _compat_gen.generated()
    for relative, text in files.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    assert _compat_gen.drift(tmp_path) == []
    edited = tmp_path / "utils" / "tensor_fragment.py"
    edited.write_text(edited.read_text().replace("safe_get_full_grad,\n", ""))
    (tmp_path / "ops" / "lion.py").unlink()
    assert _compat_gen.drift(tmp_path) == [
        "ds_all/ops/lion.py: missing (the table lists it)",
        "ds_all/utils/tensor_fragment.py: differs from ds_all/_deepspeed_paths.py (edit the table, then run "
        "python -m ds_all._compat_gen)"]


def test_generated_and_hand_written_files_are_apart():
    root = Path(_compat_gen.__file__).parent
    for path, module in DEEPSPEED.items():
        text = (root / _compat_gen.file_of(path)).read_text()
        assert text.startswith(_compat_gen.HEADER) != module.hand, path
        if module.hand:
            with pytest.raises(ValueError, match="hand-written"):
                _compat_gen.render(path, module)


@pytest.mark.parametrize("path, name, owner", CASES, ids=[f"{p}.{n}" for p, n, _ in CASES])
def test_each_table_path_is_a_module_holding_the_owners_object(path, name, owner):
    module = importlib.import_module(f"ds_all.{path}")  # `import deepspeed.x.y` works
    assert type(module).__name__ == "module" and sys.modules[f"ds_all.{path}"] is module
    parent, _, leaf = f"ds_all.{path}".rpartition(".")
    assert getattr(importlib.import_module(parent), leaf) is module or (path, leaf) == ("utils.z3_leaf_module",
                                                                                        "z3_leaf_module")
    if owner is None:
        assert hasattr(module, name)
    else:
        assert getattr(module, name) is _resolve(owner)


@pytest.mark.parametrize("path", sorted(p for p, m in DEEPSPEED.items() if m.star or m.submodules))
def test_star_and_submodule_entries(path):
    module = importlib.import_module(f"ds_all.{path}")
    entry = DEEPSPEED[path]
    if entry.star:
        owner = importlib.import_module(entry.star)
        assert all(getattr(module, name) is getattr(owner, name) for name in owner.__all__)
    for sub in entry.submodules.split():
        assert getattr(module, sub) is importlib.import_module(f"ds_all.{path}.{sub}")


@pytest.mark.parametrize("path", sorted(p for p, m in DEEPSPEED.items() if m.refused))
def test_refused_names_are_import_errors_naming_them(path):
    names, what = DEEPSPEED[path].refused
    for name in names.split():
        with pytest.raises(ImportError, match=re.escape(f"deepspeed.{path}.{name} ({what}) is not implemented")):
            exec(f"from ds_all.{path} import {name}", {})


def test_the_state_access_functions_are_one_list():
    import ds_zero

    names = SAFE_FUNCTIONS.split()
    assert len(names) == 13 and set(names) <= set(ds_zero.__all__)
    for path in ("utils", "utils.tensor_fragment"):
        assert set(names) <= set(importlib.import_module(f"ds_all.{path}").__all__)


def _in_reference(path: str) -> bool:
    """A module of DeepSpeed's, or a module-valued attribute of its parent (``deepspeed.zero``)."""
    parent, _, leaf = path.rpartition(".")
    return path in REFERENCE_MODULES or leaf in REFERENCE_MODULES.get(parent, ())


def test_every_table_path_and_name_is_deepspeeds():
    assert REFERENCE["deepspeed"] == "0.19.8" and len(REFERENCE_MODULES) > 700
    invented = sorted(path for path, entry in DEEPSPEED.items() if _in_reference(path) == bool(entry.legacy))
    assert invented == [], f"paths DeepSpeed 0.19.8 does not have (or has, though marked legacy): {invented}"
    wrong_extras = {}
    for path, entry in DEEPSPEED.items():
        if entry.legacy:
            continue
        names = {*entry.names, *entry.constants, *entry.provides.split(), *entry.submodules.split()}
        reference = REFERENCE_MODULES.get(path, set()) | {
            sub.rpartition(".")[2] for sub in REFERENCE_MODULES if sub.rpartition(".")[0] == path}
        if path not in REFERENCE_MODULES:  # deepspeed.zero is deepspeed.runtime.zero
            reference = REFERENCE_MODULES.get({"zero": "runtime.zero", "checkpointing":
                                               "runtime.activation_checkpointing.checkpointing"}[path], set())
        not_deepspeeds = names - reference
        if not_deepspeeds != set(entry.extra.split()):
            wrong_extras[path] = sorted(not_deepspeeds)
    assert wrong_extras == {}, f"names that are not DeepSpeed's, and not listed as extra: {wrong_extras}"


def test_reference_entries_not_provided(capsys):
    """Not a pin: prints how much of DeepSpeed 0.19.8's module tree ds provides (a count and a summary)."""
    provided = {path for path in DEEPSPEED if path in REFERENCE_MODULES}
    missing = sorted(set(REFERENCE_MODULES) - provided - {""})
    by_area = Counter(".".join(path.split(".")[:2]) if path.startswith("runtime.") else path.split(".")[0]
                      for path in missing)
    star = {p for p in provided if DEEPSPEED[p].star}
    missing_names = sum(len({n for n in REFERENCE_MODULES[p] if not n.startswith("_")} - set(DEEPSPEED[p].names)
                            - set(DEEPSPEED[p].provides.split()) - set(DEEPSPEED[p].constants))
                        for p in provided - star)
    with capsys.disabled():
        print(f"\nDeepSpeed 0.19.8: {len(REFERENCE_MODULES)} modules; ds provides {len(provided)} of them "
              f"({len(DEEPSPEED)} table paths), {len(missing)} not provided; in the provided modules (star "
              f"re-exports aside) {missing_names} public names not provided. Not provided, by area: "
              + ", ".join(f"{area} {n}" for area, n in by_area.most_common()))
    assert len(missing) + len(provided) + 1 == len(REFERENCE_MODULES) + ("" in provided)


def test_the_hand_pinned_paths_are_in_the_table():
    """test_deepspeed_paths.py's hand list (kept as an independent pin) is covered by the table."""
    tree = ast.parse((Path(__file__).parent / "test_deepspeed_paths.py").read_text())
    paths = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                 and getattr(node.targets[0], "id", "") == "PATHS")
    pinned = [(triple.elts[0].value, triple.elts[1].value) for triple in paths.elts]
    assert len(pinned) > 60
    table = {(f"ds_all.{path}", name) for path, name, _ in CASES}
    stars = {f"ds_all.{path}" for path, entry in DEEPSPEED.items() if entry.star}
    outside = [(p, n) for p, n in pinned if (p, n) not in table and p not in stars]
    assert outside == []


def test_the_table_getters_are_methods_reading_their_config_value():
    """``CONFIG_GETTERS``: each is a real method of DeepSpeedEngine, named and documented, returning the value
    a DeepSpeed config gives at its path (values unlike the defaults, so a wrong path shows)."""
    from types import SimpleNamespace

    from ds_all import Config, DeepSpeedEngine
    from ds_all._engine_getters import CONFIG_GETTERS, EngineGetters

    for name, path in CONFIG_GETTERS.items():
        method = getattr(DeepSpeedEngine, name)
        assert callable(method) and method.__name__ == name and path in method.__doc__
        assert vars(EngineGetters)[name] is method
    config = Config.load({"train_batch_size": 8, "fp16": {"enabled": True, "auto_cast": True},
                          "zero_optimization": {"stage": 2, "reduce_bucket_size": 12345, "overlap_comm": False,
                                                "use_multi_rank_bucket_allreduce": False},
                          "flops_profiler": {"top_modules": 7, "output_file": "flops.txt"},
                          "dataloader_drop_last": True})
    engine = SimpleNamespace(config=config)
    got = {name: EngineGetters.__dict__[name](engine) for name in (
        "fp16_auto_cast", "zero_reduce_bucket_size", "zero_overlap_comm", "zero_multi_rank_bucket_allreduce",
        "flops_profiler_top_modules", "flops_profiler_output_file", "dataloader_drop_last")}
    assert got == {"fp16_auto_cast": True, "zero_reduce_bucket_size": 12345, "zero_overlap_comm": False,
                   "zero_multi_rank_bucket_allreduce": False, "flops_profiler_top_modules": 7,
                   "flops_profiler_output_file": "flops.txt", "dataloader_drop_last": True}
