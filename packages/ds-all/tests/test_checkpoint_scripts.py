"""What DeepSpeed users do with a checkpoint folder besides loading it: run the ``zero_to_fp32.py`` that
DeepSpeed's save puts there (the Transformers guide's ``python zero_to_fp32.py . output_dir``), as a
script, in the folder, with nothing else on the path; and its sibling ``zero_to_torch.py --dtype``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import ds_all
from ds_comm.testing import spawn


def _save(rank, world_size, path, stage):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))
    model.register_buffer("scale", torch.tensor([0.5, 1.5, 2.5]))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
              "zero_optimization": {"stage": stage}, "steps_per_print": 1000}
    engine, *_ = ds_all.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        loss = engine(torch.randn(2, 6, generator=g)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(path)
    with ds_all.zero.GatheredParameters(list(engine.module.parameters())):
        weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    engine.destroy()
    return weights


def _run(script: str, *args: str, cwd: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}  # what a user's shell has
    return subprocess.run([sys.executable, script, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_to_fp32_py_in_the_checkpoint_folder_writes_the_trained_weights(tmp_path, stage):
    path = str(tmp_path / "ckpt")
    weights = spawn(_save, world_size=2, args=(path, stage))[0]
    assert (tmp_path / "ckpt" / "zero_to_fp32.py").stat().st_mode & 0o100  # executable, as DeepSpeed's
    done = _run("zero_to_fp32.py", ".", "out", cwd=path)
    assert done.returncode == 0, done.stderr
    saved = torch.load(tmp_path / "ckpt" / "out" / "pytorch_model.bin", weights_only=True)
    assert saved.keys() == weights.keys()
    for name, value in weights.items():
        assert saved[name].dtype == torch.float32 and torch.equal(saved[name], value.float()), name

    done = _run("zero_to_torch.py", ".", "out16", "--dtype", "bf16", "--safe_serialization", cwd=path)
    assert done.returncode == 0, done.stderr
    from safetensors.torch import load_file

    half = load_file(tmp_path / "ckpt" / "out16" / "model.safetensors")
    assert all(half[n].dtype == torch.bfloat16 and torch.equal(half[n], v.to(torch.bfloat16))
               for n, v in weights.items())


def test_the_recovery_scripts_refuse_bad_input_by_name(tmp_path):
    from ds_zero import write_recovery_scripts

    write_recovery_scripts(tmp_path)
    done = _run("zero_to_fp32.py", str(tmp_path / "nowhere"), "out", cwd=str(tmp_path))
    assert done.returncode == 2 and "nowhere" in done.stderr
    done = _run("zero_to_torch.py", ".", "out", "--dtype", "int8", cwd=str(tmp_path))
    assert done.returncode == 2 and "invalid choice: 'int8'" in done.stderr
    done = _run("zero_to_torch.py", ".", "out", cwd=str(tmp_path))
    assert done.returncode == 2 and "--dtype" in done.stderr
    sys.path.insert(0, str(tmp_path))
    try:  # imported as a module, it gives DeepSpeed's function names
        import zero_to_fp32

        from ds_all.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        assert zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint is get_fp32_state_dict_from_zero_checkpoint
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("zero_to_fp32", None)
