"""``ds-report``'s CUDA rows: nvcc (path and release, or "not found"), the GPU torch sees, and which
kernel each optimizer runs on CUDA tensors."""

from __future__ import annotations

import os
import shutil
import stat

import pytest
import torch

from ds_ops import report

_WHICH = shutil.which


def _rows(text: str) -> dict[str, str]:
    return {line.split(None, 1)[0]: line.split(None, 1)[1] for line in text.splitlines() if len(line.split(None, 1)) == 2}


def test_nvcc_not_found_is_said(monkeypatch):
    monkeypatch.setattr(report.shutil, "which", lambda name: None)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    assert report.nvcc().startswith("not found (not on PATH, nor in CUDA_HOME/bin")
    assert _rows(report.report())["nvcc"].startswith("not found")


def test_nvcc_path_and_release_from_its_version_output(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "nvcc"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                    "echo 'Cuda compilation tools, release 12.9, V12.9.41'\necho 'Build cuda_12.9'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(report.shutil, "which", lambda name: None)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert report.nvcc() == f"{fake} — Cuda compilation tools, release 12.9, V12.9.41"
    monkeypatch.delenv("CUDA_HOME")
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(report.shutil, "which", _WHICH)
    assert _rows(report.report())["nvcc"] == f"{fake} — Cuda compilation tools, release 12.9, V12.9.41"


def test_gpu_row_and_the_kernels_on_cuda():
    text = report.report()
    rows = _rows(text)
    if torch.cuda.is_available():
        assert rows["GPU"].startswith(torch.cuda.get_device_name(0))
        assert "on CUDA tensors (available here)" in text
    else:
        assert rows["GPU"].startswith("none (torch.cuda.is_available() is False")
        assert "on CUDA tensors (no GPU here)" in text
    assert rows["FusedAdam"].startswith("torch's fused multi-tensor Adam (torch._fused_adamw_")
    assert rows["FusedLamb"].startswith("torch ops on the device")
    assert rows["CPUAdam"].startswith("host tensors only: the cpu_adam kernel")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_gpu_row_names_the_device():
    major, minor = torch.cuda.get_device_capability(0)
    assert _rows(report.report())["GPU"].startswith(f"{torch.cuda.get_device_name(0)} (compute capability "
                                                    f"{major}.{minor})")
