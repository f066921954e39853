"""``ds_ops.get_accelerator()``: DeepSpeed's accelerator object. On this CPU: the CPU accelerator, whose memory
figures are the process's resident set (read here from /proc independently), streams and events no-ops,
and the choice by ``DS_ACCELERATOR`` refused with a clear message when it names something ds has not built."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import ds_ops
from ds_ops import Accelerator, get_accelerator


def _vm_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU accelerator is the default only without a GPU")
def test_the_cpu_accelerator_answers_as_deepspeeds():
    acc = get_accelerator()
    assert acc is get_accelerator() and isinstance(acc, Accelerator)
    assert (acc.device_name(), acc.device_name(1), acc.current_device_name()) == ("cpu", "cpu", "cpu")
    assert acc.device() == torch.device("cpu") and acc.communication_backend_name() == "gloo"
    assert acc.is_available() and acc.is_synchronized_device() and acc.use_host_timers()
    assert acc.is_bf16_supported() and torch.bfloat16 in acc.supported_dtypes()
    assert acc.current_device() == int(os.environ.get("LOCAL_RANK", 0))
    assert acc.on_accelerator(torch.zeros(1)) and acc.Stream is None and acc.Event is None
    with acc.stream(acc.current_stream()):
        acc.synchronize()
    t = torch.ones(3)
    assert acc.pin_memory(t) is t and not acc.is_pinned(t)
    acc.manual_seed(7)
    a = torch.rand(2)
    acc.manual_seed(7)
    assert torch.equal(a, torch.rand(2)) and acc.initial_seed() == 7
    assert acc.FloatTensor == "torch.FloatTensor" and acc.BFloat16Tensor == "torch.BFloat16Tensor"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU memory figures")
def test_cpu_memory_figures_are_the_resident_set_and_its_peak():
    acc = get_accelerator()
    acc.reset_peak_memory_stats()
    before = acc.memory_allocated()
    assert abs(before - _vm_rss()) < 8 << 20
    block = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB touched
    during = acc.memory_allocated()
    assert during - before > 60 << 20 and abs(during - _vm_rss()) < 8 << 20
    del block
    assert acc.max_memory_allocated() >= during and acc.memory_stats()["allocated_bytes.all.peak"] >= during
    acc.reset_peak_memory_stats()
    assert acc.max_memory_allocated() < during
    assert 0 < acc.available_memory() <= acc.total_memory()


CHOICE = "import ds_ops; print(ds_ops.get_accelerator())"


def _choose(value: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHOICE], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "DS_ACCELERATOR": value})


def test_ds_accelerator_picks_and_unknown_values_are_refused():
    assert _choose("cpu").stdout.strip() == "Accelerator('cpu')"
    bad = _choose("xpu")
    assert bad.returncode != 0 and "DS_ACCELERATOR must be one of cpu, cuda (ds builds no other), got 'xpu'" in bad.stderr
    if not torch.cuda.is_available():
        no_gpu = _choose("cuda")
        assert no_gpu.returncode != 0 and "accelerator 'cuda' needs a CUDA build of torch and a visible GPU" in no_gpu.stderr


def test_set_accelerator_replaces_the_choice_and_checks_its_argument():
    first = get_accelerator()
    try:
        other = Accelerator("cpu")
        ds_ops.set_accelerator(other)
        assert get_accelerator() is other
        with pytest.raises(ValueError, match=r"set_accelerator takes a ds_ops\.Accelerator, got str"):
            ds_ops.set_accelerator("cpu")
        with pytest.raises(ValueError, match="accelerator must be one of cpu, cuda, got 'tpu'"):
            Accelerator("tpu")
    finally:
        ds_ops.set_accelerator(first)


def test_pinned_empty_is_a_plain_host_tensor_on_the_cpu_accelerator():
    acc = Accelerator("cpu")
    t = acc.pinned_empty((3, 5), torch.bfloat16)
    assert t.shape == (3, 5) and t.dtype == torch.bfloat16 and t.device.type == "cpu" and not t.is_pinned()
    assert acc.pinned_empty(7).dtype == torch.float32


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_pinned_empty_is_page_locked():
    acc = Accelerator("cuda")
    t = acc.pinned_empty(1 << 20, torch.float16)
    assert t.is_pinned() and acc.is_pinned(t) and acc.is_pinned(acc.pin_memory(torch.ones(4)))
