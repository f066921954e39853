"""initialize() with a ds_pipe.PipelineModule: the PipelineEngine trains like the unsplit model under
ZeRO 0-2 (2 stages x 2 data-parallel replicas), with every schedule, clipping by the whole model's gradient
norm; what it refuses."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_comm.testing import free_port, spawn

D, ROWS, MICRO_BATCHES, STEPS, LR = 12, 3, 4, 3, 0.05
CLIP = 0.05  # below the gradients' norm: every step clips, by the whole model's norm (all stages)


def layer_specs():
    from ds_pipe import LayerSpec
    return [LayerSpec(nn.Linear, 6, D), LayerSpec(nn.LayerNorm, D), LayerSpec(nn.Linear, D, D), LayerSpec(nn.Tanh),
            LayerSpec(nn.Linear, D, D), LayerSpec(nn.Linear, D, 2)]


def micro_batches(step: int, replica: int):
    g = torch.Generator().manual_seed(10 * step + replica)
    return [(torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 2, generator=g)) for _ in range(MICRO_BATCHES)]


def reference(replicas: int) -> tuple[list[float], list[list[float]]]:
    layers = []
    for i, spec in enumerate(layer_specs()):
        torch.manual_seed(1234 + i)
        layers.append(spec.build())
    model = nn.Sequential(*layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for replica in range(replicas):
            for x, y in micro_batches(step, replica):
                loss = F.mse_loss(model(x), y)
                (loss / (MICRO_BATCHES * replicas)).backward()
                total += loss.item()
        assert torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP) > CLIP
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / (MICRO_BATCHES * replicas))
    return losses, [p.detach().flatten().tolist() for p in model.parameters()]


def train(rank, world, stage, schedule):
    import ds_all
    from ds_pipe import PipelineModule
    module = PipelineModule(layer_specs(), num_stages=2, loss_fn=F.mse_loss, seed_layers=True,
                            partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": MICRO_BATCHES,
              "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_optimization": {"stage": stage},
              "pipeline": {"schedule": schedule}, "steps_per_print": 1000, "gradient_clipping": CLIP}
    engine, *_ = ds_all.initialize(model=module, config=config)
    assert type(engine).__name__ == "PipelineEngine" and engine.train_batch_size() == ROWS * MICRO_BATCHES * 2
    replica = module.mpu().get_data_parallel_rank()
    losses = [float(engine.train_batch(iter(micro_batches(step, replica)))) for step in range(STEPS)]
    params = {f"{idx}.{name}": p.detach().flatten().tolist() for idx in module.chunk_layers(0)
              for name, p in getattr(module, str(idx)).named_parameters()}
    engine.destroy()
    return losses, params, engine.global_steps


CASES = [(0, "1f1b"), (1, "1f1b"), (2, "1f1b"), (1, "zero_bubble"), (2, "zero_bubble")]


def train_cases(rank, world):
    return [train(rank, world, stage, schedule) for stage, schedule in CASES]


def test_pipeline_engine_under_zero_trains_like_the_unsplit_model():
    ref_losses, ref_params = reference(replicas=2)
    names = [f"{i}.{n}" for i, spec in enumerate(layer_specs()) for n, _ in spec.build().named_parameters()]
    want = dict(zip(names, ref_params, strict=True))
    results = spawn(train_cases, world_size=4, timeout=240)
    for c, (stage, schedule) in enumerate(CASES):
        seen = set()
        for rank in range(4):
            losses, params, steps = results[rank][c]
            assert steps == STEPS
            assert losses == pytest.approx(ref_losses, rel=1e-6), (stage, schedule, rank)
            for name, values in params.items():
                torch.testing.assert_close(torch.tensor(values), torch.tensor(want[name]), rtol=1e-6, atol=1e-6,
                                           msg=lambda m, where=f"stage {stage} {schedule} {name}": f"{where}: {m}")
                seen.add(name)
        assert seen == set(names), (stage, schedule)  # every layer is on some stage


def refusals(rank, world):
    import ds_all
    from ds_pipe import PipelineModule
    module = PipelineModule(layer_specs(), num_stages=2, loss_fn=F.mse_loss)
    base = {"train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": 2,
            "optimizer": {"type": "SGD", "params": {"lr": LR}}}
    out = {}
    for name, extra in [("stage 3", {"zero_optimization": {"stage": 3}}), ("stages", {"pipeline": {"stages": 4}})]:
        try:
            ds_all.initialize(model=module, config={**base, **extra})
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    chunked = PipelineModule(layer_specs(), num_stages=2, loss_fn=F.mse_loss, virtual_stages=2)
    try:  # the executor refuses after ZeRO is built: ZeRO lets go of the model again
        ds_all.initialize(model=chunked, config=base)
        out["chunks"] = "no error"
    except ValueError as e:
        out["chunks"] = str(e)
    out["chunks left alone"] = all(p.grad is None for p in chunked.parameters())
    engine, *_ = ds_all.initialize(model=module, config=base)
    for call in ("forward", "backward", "step"):
        try:
            getattr(engine, call)(torch.zeros(1))
            out[call] = "no error"
        except RuntimeError as e:
            out[call] = str(e)
    try:
        engine.train_batch()
    except ValueError as e:
        out["no data"] = str(e)
    return out


def test_pipeline_engine_refuses_what_it_cannot_do():
    for out in spawn(refusals, world_size=2):
        assert out["stage 3"].startswith("initialize: a PipelineModule trains with zero_optimization.stage 0, 1 or 2, "
                                         "got 3")
        assert out["stages"] == "initialize: pipeline.stages is 4 but the PipelineModule has 2 stages"
        assert out["chunks"].startswith("PipelineExecutor: the module has virtual_stages=2"), out["chunks"]
        assert out["chunks left alone"]
        assert out["forward"].startswith("PipelineEngine: the schedule runs the forward")
        assert out["step"].startswith("PipelineEngine: train_batch() steps the optimizer")
        assert out["no data"].startswith("engine.train_batch: no data for this stage")


def test_the_readme_pipeline_example_runs_on_two_ranks_and_prints_what_it_says(tmp_path):
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.findall(r"```python\n(.*?)```", readme.split("## Pipelines", 1)[1], re.S)[0]
    promised = re.search(r"# (.+)$", block.strip().splitlines()[-1]).group(1)
    script = tmp_path / "pipeline_example.py"
    script.write_text(block)
    result = subprocess.run([sys.executable, "-m", "ds_launch", "--num_procs", "2", "--master_port", str(free_port()),
                             "--enable_each_rank_log", str(tmp_path / "logs"), str(script)],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    logs = [(tmp_path / "logs" / f"rank{r}.log").read_text() for r in range(2)]
    assert [log.splitlines().count(promised) for log in logs] == [1, 1], logs
    assert re.search(r"^\[ds_all\] step=20, ", logs[0], re.M), logs[0]  # steps_per_print 10, rank 0
