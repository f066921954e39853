"""On a GPU: the same counts as on CPU, latencies from CUDA events. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from _models import GPT, gpt_counts, profile

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_gpt_on_cuda_counts_the_same_and_times_with_events():
    model = GPT().eval().cuda()
    prof = profile(model, torch.zeros(2, 16, dtype=torch.long, device="cuda"))
    try:
        assert (prof.get_total_flops(), prof.get_total_macs()) == gpt_counts(2, 16)
        tree = prof.get_profile()
        assert tree.duration > 0 and all(block.duration > 0 for block in tree.find("blocks").children)
        assert sum(child.duration for child in tree.children) <= tree.duration * 1.01
    finally:
        prof.end_profile()
