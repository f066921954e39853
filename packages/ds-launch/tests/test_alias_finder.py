"""`ds_launch.alias_finder.AliasFinder`, the one ``deepspeed`` -> ``ds_all`` import alias (ds-launch's
``--deepspeed_alias`` package and ``ds_all.hf.trainer`` both use it), shown on a standard-library package."""

from __future__ import annotations

import importlib
import json
import re
import sys

import pytest

from ds_launch.alias_finder import AliasFinder


@pytest.fixture
def alias():
    finder = AliasFinder("json_alias_for_test", "json")
    sys.meta_path.insert(0, finder)
    sys.modules["json_alias_for_test"] = json
    try:
        yield finder
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n.split(".")[0] == "json_alias_for_test"]:
            del sys.modules[name]


def test_a_submodule_of_the_alias_is_the_targets_module_itself(alias):
    import json.decoder

    aliased = importlib.import_module("json_alias_for_test.decoder")
    assert aliased is json.decoder and aliased.__spec__.name == "json.decoder"  # its own spec given back
    assert sys.modules["json_alias_for_test.decoder"] is json.decoder
    # a `from` import of a submodule not yet aliased
    from json_alias_for_test.scanner import make_scanner

    assert make_scanner is json.scanner.make_scanner


def test_a_missing_submodule_is_pythons_usual_error(alias):
    with pytest.raises(ModuleNotFoundError, match=re.escape("No module named 'json_alias_for_test.nope'")):
        importlib.import_module("json_alias_for_test.nope")
    assert alias.find_spec("elsewhere.decoder") is None


def test_alias_and_target_must_be_top_level_names():
    with pytest.raises(ValueError, match=re.escape("got 'deep.speed' and 'ds_all'")):
        AliasFinder("deep.speed", "ds_all")
