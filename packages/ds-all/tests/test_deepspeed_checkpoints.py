"""Checkpoints written by the real DeepSpeed 0.19.8 (fixtures/deepspeed_checkpoints, made by its gen.py) load
into ds: stages 0-3 in fp32, bf16 and fp16, and a universal checkpoint of DeepSpeed's ds_to_universal, at the
same world size and stage, at another stage, and on 1 rank instead of 2. Every weight and Adam state equals
what DeepSpeed itself reported at the save (``safe_get_full_*``), so do the step, schedule, counters, client
state and loss scale; two more steps give DeepSpeed's losses after its own load. ``ds-zero-to-fp32`` returns
what DeepSpeed's zero_to_fp32 returned from the same directories. Files are read with weights_only=True:
anything but DeepSpeed's known objects is refused by name."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ds_all
import ds_zero
from ds_comm.testing import spawn

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed_checkpoints"
EXPECTED = torch.load(FIXTURES / "expected.pt", weights_only=True)
CASES = EXPECTED["cases"]
STEPS, MORE = 3, 2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = {"fp32": 1e-6, "bf16": 5e-3, "fp16": 5e-4}  # the losses of the 2 steps after the load (measured: 0, 2.2e-3, 1.4e-4)


class Net(torch.nn.Module):  # gen.py's model
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(7, 13)
        self.norm = torch.nn.LayerNorm(13)
        self.fc2 = torch.nn.Linear(13, 5, bias=False)
        self.register_buffer("shift", torch.linspace(-0.5, 0.5, 5))

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(x)))) + self.shift


class TiedNet(torch.nn.Module):  # gen.py's: a weight tied between two modules and a frozen layer
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(7, 9)
        self.up = torch.nn.Linear(9, 9, bias=False)
        self.frozen = torch.nn.Linear(9, 9)
        self.frozen.requires_grad_(False)
        self.norm = torch.nn.LayerNorm(9)
        self.down = torch.nn.Linear(9, 9, bias=False)
        self.down.weight = self.up.weight
        self.out = torch.nn.Linear(9, 5)
        self.register_buffer("shift", torch.linspace(-0.5, 0.5, 5))

    def forward(self, x):
        return self.out(self.down(self.norm(self.frozen(torch.tanh(self.up(self.inp(x))))))) + self.shift


def _config(stage: int, precision: str, micro: int, universal: bool = False) -> dict:
    out = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.99], "eps": 1e-8,
                                                     "weight_decay": 0.01, "torch_adam": True}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01,
                                                        "warmup_num_steps": 10, "warmup_type": "linear"}},
           "zero_optimization": {"stage": stage}, "steps_per_print": 1000,
           "gradient_clipping": 1.0}  # DeepSpeed 0.19.8's default, which gen.py's runs had
    if precision == "bf16":
        out["bf16"] = {"enabled": True}
    if precision == "fp16":
        out["fp16"] = {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 2, "hysteresis": 1,
                       "min_loss_scale": 1}
    if universal:
        out["checkpoint"] = {"load_universal": True}
    return out


def resume(rank, world_size, jobs):
    return [_resume(rank, world_size, *job) for job in jobs]


def _resume(rank, world_size, directory, stage, precision, universal, saved_to, tied):
    """Load DeepSpeed's checkpoint into a fresh engine, save it in ds's format (to compare its states), then
    train 2 more steps on gen.py's data (on 1 rank: both of DeepSpeed's ranks' batches)."""
    torch.manual_seed(1)  # other initial weights than DeepSpeed's run: the load must replace them
    model = TiedNet() if tied else Net()
    if tied:
        torch.nn.init.zeros_(model.frozen.weight)  # the checkpoint's frozen layer (gen.py's seed 0) must come back
    engine, *_ = ds_all.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                   config=_config(stage, precision, 2 * (3 - world_size), universal))
    path, client = engine.load_checkpoint(directory)
    after = {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
             "lr": engine.get_lr()[0], "lr_scheduler": engine.lr_scheduler.state_dict(),
             "loss_scale": engine.optimizer.loss_scale if precision == "fp16" else None,
             "client": {k: client.get(k) for k in EXPECTED["client_state"]}, "ds_version": client.get("ds_version"),
             "path": path}
    engine.save_checkpoint(saved_to, tag="after_load")
    losses = []
    for step in range(STEPS, STEPS + MORE):
        pairs = [EXPECTED["data"][(step, r)] for r in ([rank] if world_size == 2 else [0, 1])]
        x, y = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
        out = engine(x.to(DTYPES[precision]))
        loss = ((out.float() - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    after["losses"] = losses
    return after


def _ds_states(path: Path, shapes: dict[str, torch.Size]) -> dict[str, dict[str, torch.Tensor]]:
    """The float32 weights and Adam states ds saved (read from its own checkpoint, in this process)."""
    wanted = {"optim_scalar/step": torch.zeros(())}
    for name, shape in shapes.items():
        for key in ("master", "optim/exp_avg", "optim/exp_avg_sq"):
            wanted[f"{key}/{name}"] = torch.empty(shape.numel())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(wanted, storage_reader=ds_zero.SafeReader(str(path)), no_dist=True)
    out = {key: {n: wanted[f"{prefix}/{n}"].view(s) for n, s in shapes.items()}
           for key, prefix in (("weights", "master"), ("exp_avg", "optim/exp_avg"), ("exp_avg_sq", "optim/exp_avg_sq"))}
    out["step"] = wanted["optim_scalar/step"].item()
    return out


def _check(after: dict, states: dict, reference: dict, precision: str) -> None:
    for key in ("weights", "exp_avg", "exp_avg_sq"):
        for name, expected in reference[key].items():
            assert torch.equal(states[key][name], expected), f"{key} of {name}"
    assert [states["step"]] == reference["step"]
    assert after["global_steps"] == reference["global_steps"] == STEPS
    assert after["global_samples"] == reference["global_samples"]
    assert after["lr_scheduler"] == reference["lr_scheduler"]
    assert after["lr"] == pytest.approx(reference["lr"], rel=1e-12)
    assert after["loss_scale"] == reference["loss_scale"]
    assert after["client"] == EXPECTED["client_state"] and after["ds_version"] == "0.19.8"


def _job(tmp_path: Path, case: str, stage: int | None = None, universal: bool = False) -> tuple:
    record = CASES[case]
    directory = FIXTURES / ("s2_fp32" if universal else case)
    stage = record.get("stage", 2) if stage is None else stage
    saved_to = tmp_path / f"{case}-{stage}"
    return str(directory), stage, record.get("precision", "fp32"), universal, str(saved_to), record.get("tied", False)


def _verify(case: str, world_size: int, job: tuple, results: list[dict]) -> None:
    universal, precision, saved_to = job[3], job[2], Path(job[4])
    reference = CASES["s2_fp32" if universal else case]["saved"]
    states = _ds_states(saved_to / "after_load", {n: t.shape for n, t in reference["weights"].items()})
    for after in results:
        _check(after, states, reference, precision)
    if CASES[case].get("tied"):  # the frozen layer, as DeepSpeed's zero_to_fp32 reads it from the checkpoint
        frozen = {f"module/frozen.{k}": torch.empty(t.shape) for k, t in (("weight", torch.empty(9, 9)),
                                                                            ("bias", torch.empty(9)))}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(frozen, storage_reader=ds_zero.SafeReader(str(saved_to / "after_load")), no_dist=True)
        assert all(torch.equal(t, CASES[case]["zero_to_fp32"][k[7:]]) for k, t in frozen.items())
    losses = CASES[case]["losses_after"]
    if case == "s0_fp16":  # DeepSpeed's FP16_UnfusedOptimizer updates otherwise than ZeRO's fp16 (and ds-zero's):
        losses = [r[:1] for r in losses]  # the forward on the loaded weights only; its states are checked above
        results = [{**r, "losses": r["losses"][:1]} for r in results]
    if world_size == 2:
        for result, expected in zip(results, losses, strict=True):
            assert result["losses"] == pytest.approx(expected, abs=TOLERANCE[precision]), case
    else:  # one rank on both ranks' samples: the mean of DeepSpeed's two losses
        means = [(a + b) / 2 for a, b in zip(*losses, strict=True)]
        assert results[0]["losses"] == pytest.approx(means, abs=TOLERANCE[precision]), case


def _run(tmp_path: Path, world_size: int, cases: list[tuple[str, int | None, bool]]) -> list[list[dict]]:
    """Every case in one launch of ``world_size`` ranks; returns each case's results per rank."""
    jobs = [_job(tmp_path, case, stage, universal) for case, stage, universal in cases]
    per_rank = spawn(resume, world_size=world_size, timeout=120, args=(jobs,))
    out = []
    for i, ((case, _, _), job) in enumerate(zip(cases, jobs, strict=True)):
        results = [rank_results[i] for rank_results in per_rank]
        _verify(case, world_size, job, results)
        out.append(results)
    return out


def test_deepspeed_checkpoints_resume_on_two_ranks(tmp_path):
    """Every fixture at its own stage and precision, and two at another stage, on DeepSpeed's 2 ranks."""
    same = [(case, None, False) for case in ("s0_fp32", "s1_fp32", "s2_fp32", "s3_fp32", "s1_bf16", "s2_bf16",
                                             "s3_bf16", "s2_fp16", "s0_fp16", "s2_tied_fp32", "s3_tied_fp32")]
    _run(tmp_path, 2, [*same, ("s3_fp32", 1, False), ("s1_bf16", 3, False)])


def test_deepspeed_checkpoints_resume_on_one_rank_at_another_stage(tmp_path):
    """2 ranks -> 1, at another stage; and the universal checkpoint, with ``checkpoint.load_universal`` (the
    tag is what ``latest_universal`` names: DeepSpeed's rule)."""
    cases = [("s3_fp32", 1, False), ("s2_fp32", 3, False), ("s0_fp32", 2, False), ("s3_bf16", 2, False),
             ("s3_tied_fp32", 1, False), ("universal_s2_fp32", 3, True)]
    results = _run(tmp_path, 1, cases)
    assert results[-1][0]["path"].endswith("global_step3_universal")


def module_only(rank, world_size, directory, saved_to):
    model = Net()
    engine, *_ = ds_all.initialize(model=model, model_parameters=model.parameters(), config=_config(1, "fp32", 4))
    _, client = engine.load_checkpoint(directory, load_module_only=True)
    engine.save_checkpoint(saved_to, tag="after_load")
    return engine.global_steps, engine.get_lr()[0], sorted(client)


def test_load_module_only_takes_the_weights_and_nothing_else(tmp_path):
    """DeepSpeed's rule: the weights only; the counters and schedule stay, every other entry is the client's."""
    steps, lr, client = spawn(module_only, world_size=1, args=(str(FIXTURES / "s3_fp32"), str(tmp_path)))[0]
    reference = CASES["s3_fp32"]["saved"]
    wanted = {f"master/{n}": torch.empty(t.numel()) for n, t in reference["weights"].items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(wanted, storage_reader=ds_zero.SafeReader(str(tmp_path / "after_load")), no_dist=True)
    assert all(torch.equal(wanted[f"master/{n}"].view(t.shape), t) for n, t in reference["weights"].items())
    saved = ds_zero.SafeReader(str(tmp_path / "after_load")).read_metadata().state_dict_metadata
    assert not any(key.startswith("optim") for key in saved)  # no optimizer state was loaded
    assert steps == 0 and lr == 0.001  # WarmupLR's first value: the schedule was not loaded
    assert {"global_steps", "global_samples", "skipped_steps", "ds_config", *EXPECTED["client_state"]} <= set(client)
    assert not {"module", "lr_scheduler", "optimizer"} & set(client)  # (those two: load_*_states=True, DeepSpeed's)


def test_zero_to_fp32_equals_deepspeeds(tmp_path):
    for case, record in CASES.items():
        if "zero_to_fp32" not in record:
            continue
        state = ds_zero.get_fp32_state_dict_from_zero_checkpoint(FIXTURES / case)  # through 'latest'
        expected = record["zero_to_fp32"]
        assert list(state) == list(expected), case
        for name, tensor in expected.items():
            assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), (case, name)
    # what DeepSpeed's own script refuses (BF16_Optimizer's files): DeepSpeed's float32 weights all the same
    assert "not a zero checkpoint" in CASES["s1_bf16"]["zero_to_fp32_error"]
    state = ds_zero.get_fp32_state_dict_from_zero_checkpoint(FIXTURES / "s1_bf16", tag="global_step3")
    for name, tensor in CASES["s1_bf16"]["saved"]["weights"].items():
        assert torch.equal(state[name], tensor), name
    for case, tag in (("s0_fp32", None), ("s0_fp16", None), ("s2_fp32", "global_step3_universal")):  # DeepSpeed's
        # zero_to_fp32 fails on these three
        state = ds_zero.get_fp32_state_dict_from_zero_checkpoint(FIXTURES / case, tag=tag)
        reference = CASES[case]["saved"]
        assert list(state) == ["shift", *reference["weights"]]
        assert all(torch.equal(state[name], tensor) for name, tensor in reference["weights"].items())
    from ds_zero._export import main  # the ds-zero-to-fp32 command
    out = tmp_path / "model.pt"
    assert main([str(FIXTURES / "s3_bf16"), str(out)]) == 0
    written = torch.load(out, weights_only=True)
    assert all(torch.equal(written[k], v) for k, v in CASES["s3_bf16"]["zero_to_fp32"].items())


class _Payload:
    def __reduce__(self):
        return print, ("unpickled: this must never run",)


def test_a_file_with_another_global_is_refused_by_name(tmp_path):
    tag = tmp_path / "global_step3"
    shutil.copytree(FIXTURES / "s2_fp32" / "global_step3", tag)
    model_states = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)
    model_states["payload"] = _Payload()  # a crafted entry: unpickling it would call print
    torch.save(model_states, tag / "mp_rank_00_model_states.pt")
    with pytest.raises(ValueError, match=r"builtins\.print"):
        ds_zero.get_fp32_state_dict_from_zero_checkpoint(tag)


def test_tensor_parallel_pipeline_and_moe_checkpoints_are_refused(tmp_path):
    tag = tmp_path / "global_step3"
    shutil.copytree(FIXTURES / "s2_fp32" / "global_step3", tag)
    shutil.copy(tag / "mp_rank_00_model_states.pt", tag / "mp_rank_01_model_states.pt")
    with pytest.raises(NotImplementedError, match="tensor-parallel"):
        ds_zero.get_fp32_state_dict_from_zero_checkpoint(tag)
    (tag / "mp_rank_01_model_states.pt").unlink()
    shutil.copy(tag / "mp_rank_00_model_states.pt", tag / "layer_01-model_00-model_states.pt")
    with pytest.raises(NotImplementedError, match="pipeline-parallel"):
        ds_zero.get_fp32_state_dict_from_zero_checkpoint(tag)
    (tag / "layer_01-model_00-model_states.pt").rename(tag / "layer_0_expert_0_mp_rank_00_model_states.pt")
    with pytest.raises(NotImplementedError, match="MoE"):
        ds_zero.get_fp32_state_dict_from_zero_checkpoint(tag)
