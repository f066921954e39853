"""Shared helpers: the tests' models live in ``_models.py`` next to this file."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _seed_and_check_modes():
    """Every test starts seeded, and leaves torch's torch-function mode stack as it found it."""
    torch.manual_seed(0)
    before = torch._C._len_torch_function_stack()
    yield
    assert torch._C._len_torch_function_stack() == before, "a torch function mode was left on the stack"
