"""Every DeepSpeed-format config of shared/configs (copied into fixtures/deepspeed_configs) loads:
each package's section model accepts its own section as written there, and every top-level key
is one DeepSpeed knows. ds_all.Config (the engine issue) will load the whole files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ds_config import DEEPSPEED_KEYS, Section

from ds_comm import CommsLoggerConfig
from ds_compress import CompressionConfig
from ds_io import AioConfig
from ds_ops import SparseAttentionConfig
from ds_profiler import FlopsProfilerConfig
from ds_zero import BF16Config, FP16Config, ZeroConfig

CONFIGS = sorted((Path(__file__).parent / "fixtures" / "deepspeed_configs").glob("*.json"))
SHARED = Path(__file__).resolve().parents[4] / "shared" / "configs"
SECTIONS: list[type[Section]] = [CommsLoggerConfig, CompressionConfig, AioConfig, SparseAttentionConfig,
                                 FlopsProfilerConfig, ZeroConfig, FP16Config, BF16Config]


def test_the_fixtures_are_the_shared_configs():
    assert len(CONFIGS) >= 9
    if SHARED.exists():  # in a workspace with shared/ beside the checkout: still the same files
        assert {p.name: p.read_text() for p in SHARED.glob("*.json")} == {p.name: p.read_text() for p in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_section_of_every_config_loads(path):
    whole = json.loads(path.read_text())
    assert set(whole) <= DEEPSPEED_KEYS, set(whole) - DEEPSPEED_KEYS
    for model in SECTIONS:
        section = model.from_ds_config(path)
        if model.section in whole:
            # what was written is what was read (the keys given, at their values, after JSON's 5e8 -> int)
            dumped = section.model_dump(by_alias=True)
            for key, value in whole[model.section].items():
                if not isinstance(value, dict):
                    assert dumped[key] == value, (model.section, key)
        else:
            assert section == model()


def test_sections_of_the_configs_are_really_there():
    found = {model.section for path in CONFIGS for model in SECTIONS if model.section in json.loads(path.read_text())}
    assert found == {m.section for m in SECTIONS}
