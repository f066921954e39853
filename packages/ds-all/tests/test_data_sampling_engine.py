"""Data sampling by difficulty through the engine (``data_efficiency.data_sampling.curriculum_learning``): a
synthetic dataset of padded sequences indexed by `ds_data.DataAnalyzer` on a sequence-length metric, trained on
2 ranks by ``ds_all.initialize(training_data=...)``. Every batch a rank receives holds only samples whose length
(computed here) is within the difficulty of its step (DeepSpeed's fixed_linear, written out here); the ranks
take disjoint slices of each global batch (against a one-rank sampler drawing the whole micro-batch); the
post-process hook gets the sampler's difficulties and truncates the batch to them (Megatron-DeepSpeed's use);
a checkpoint mid-run then a resume gives the uninterrupted run's remaining batches and losses; DeepSpeed's
import paths are ds-data's classes."""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ds_all
import ds_data
from ds_comm.testing import spawn

N, SEQ, VOCAB = 64, 16, 8
MICRO, GAS, DP = 2, 2, 2
LOW, HIGH, TOTAL_STEP, DIFFICULTY_STEP = 4, SEQ, 6, 2
STEPS = N // (MICRO * GAS * DP)  # one epoch: 8 optimizer steps
SAVE_AT = 3
SEED = 1234


def length(i: int) -> int:
    """Sample ``i``'s number of tokens (the metric, computed here independently of the analyzer)."""
    return 1 + (i * 7) % SEQ


class Sequences(torch.utils.data.Dataset):
    """Sample ``i``: ``length(i)`` tokens in [1, VOCAB) (each the previous + 1), then padding 0."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        tokens = torch.zeros(SEQ, dtype=torch.long)
        tokens[:length(i)] = 1 + (i + torch.arange(length(i))) % (VOCAB - 1)
        return {"index": torch.tensor(i), "tokens": tokens}


def seqlen_metric(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (batch["tokens"] != 0).sum(dim=1).to(torch.int64)


def difficulty(step: int) -> int:
    """DeepSpeed's fixed_linear at curriculum step ``step``: rounded down to the difficulty step, at most HIGH."""
    d = math.floor(step / TOTAL_STEP * (HIGH - LOW) + LOW)
    return min(d - d % DIFFICULTY_STEP, HIGH)


class TinyLM(nn.Module):
    """Next-token prediction ignoring padding; records the width of each batch it sees."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB)
        self.widths: list[int] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.widths.append(tokens.shape[1])
        logits = self.head(torch.tanh(self.embed(tokens)))
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1), ignore_index=0)


def metric_config(index: str, schedule: dict | None = None) -> dict:
    return {"index_to_sample_path": f"{index}/seqlen/seqlen_index_to_sample",
            "index_to_metric_path": f"{index}/seqlen/seqlen_index_to_metric",
            "difficulty_type": "value", "clustering_type": "schedule_based",
            **(schedule or {"min_difficulty": LOW, "max_difficulty": HIGH, "schedule_type": "fixed_linear",
                            "schedule_config": {"total_curriculum_step": TOTAL_STEP,
                                                "difficulty_step": DIFFICULTY_STEP}})}


def _config(index: str, **metric: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": 100,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
            "data_efficiency": {"enabled": True, "seed": SEED, "data_sampling": {
                "enabled": True, "num_epochs": 1, "num_workers": 0, "curriculum_learning": {
                    "enabled": True, "data_cluster_path": f"{index}/clusters",
                    "curriculum_metrics": {"seqlen": metric_config(index, **metric)}}}}}


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("index")
    analyzer = ds_data.DataAnalyzer(Sequences(), ["seqlen"], [seqlen_metric], ["single_value_per_sample"],
                                    [np.int64], root, batch_size=8)
    analyzer.run_map()
    analyzer.run_reduce()
    return str(root)


def truncate(batch: dict[str, torch.Tensor], state: dict) -> dict[str, torch.Tensor]:
    """Megatron-DeepSpeed's post-process: the sequences cut to the metric's current difficulty."""
    return {**batch, "tokens": batch["tokens"][:, :state["current_difficulties"]["seqlen"]]}


def _train(engine, batches, until: int) -> tuple[list, list]:
    """(global_steps, this rank's sample indices, the difficulty the hook saw) per micro-batch, and the losses."""
    seen, losses = [], []
    while engine.global_steps < until:
        batch = next(batches)
        seen.append((engine.global_steps, batch["index"].tolist(), batch["tokens"].shape[1]))
        loss = engine(batch["tokens"])
        losses.append(float(loss))
        engine.backward(loss)
        engine.step()
    return seen, losses


def first_run(rank, world_size, index, path):
    engine, _, loader, _ = ds_all.initialize(model=TinyLM(), config=_config(index), training_data=Sequences())
    assert isinstance(loader.data_sampler, ds_data.DataSampler) and loader is engine.training_dataloader
    sampler = loader.data_sampler
    facts = (sampler.data_parallel_rank, sampler.data_parallel_size, sampler.micro_batch_size,
             sampler.gradient_accumulation_steps, sampler.global_batch_size, sampler.seed, sampler.num_epochs,
             len(loader), engine.curriculum_learning_enabled(), engine.data_sampling_enabled(),
             engine.curriculum_learning_config()["curriculum_metrics"]["seqlen"]["max_difficulty"])
    engine.set_data_post_process_func(truncate)
    batches = iter(loader)
    seen, losses = _train(engine, batches, SAVE_AT)
    engine.save_checkpoint(path)
    saved = sampler.state_dict()
    seen_after, losses_after = _train(engine, batches, STEPS)
    with pytest.raises(StopIteration):  # one epoch of samples: num_epochs 1
        next(batches)
    widths = engine.module.widths
    engine.destroy()
    return facts, seen + seen_after, losses + losses_after, saved, widths


def resumed_run(rank, world_size, index, path):
    engine, _, loader, _ = ds_all.initialize(model=TinyLM(), config=_config(index), training_data=Sequences())
    engine.set_data_post_process_func(truncate)
    engine.load_checkpoint(path)
    restored = loader.data_sampler.state_dict()
    seen, losses = _train(engine, iter(loader), STEPS)
    engine.destroy()
    return restored, seen, losses


def test_batches_follow_the_difficulty_ranks_are_disjoint_and_a_resume_continues_exactly(index, tmp_path):
    path = str(tmp_path / "ck")
    first = spawn(first_run, world_size=DP, args=(index, path), timeout=240)
    second = spawn(resumed_run, world_size=DP, args=(index, path), timeout=240)
    reference = ds_data.DataSampler(N, 1, MICRO * DP, 0, 1, GAS, curriculum_metrics={"seqlen": metric_config(index)},
                                    seed=SEED)
    whole = list(reference)  # each micro-batch of both ranks, as one rank drawing it all
    assert len(whole) == STEPS * GAS
    for rank, ((facts, seen, losses, saved, widths), (restored, resumed, resumed_losses)) in enumerate(
            zip(first, second, strict=True)):
        assert facts == (rank, DP, MICRO, GAS, MICRO * GAS * DP, SEED, 1, STEPS * GAS, True, True, HIGH)
        assert len(seen) == STEPS * GAS
        for m, (global_steps, indices, width) in enumerate(seen):
            assert global_steps == m // GAS
            allowed = difficulty(global_steps + 1)  # the sampler's step counts global batches from 1
            assert width == allowed  # the hook saw the sampler's current difficulty
            assert all(length(i) <= allowed for i in indices), (global_steps, allowed, indices)
            assert indices == whole[m][rank * MICRO:(rank + 1) * MICRO]
        assert widths == [width for _, _, width in seen]
        assert max(length(i) for _, indices, _ in seen for i in indices) > LOW  # harder samples came in
        assert all(math.isfinite(x) for x in losses)
        assert restored == saved and saved["consumed_samples"] == SAVE_AT * GAS * MICRO * DP
        assert resumed == seen[SAVE_AT * GAS:]
        assert resumed_losses == losses[SAVE_AT * GAS:]
    ranks = [[set(indices) for _, indices, _ in out[1]] for out in first]
    for m, (mine, theirs) in enumerate(zip(*ranks, strict=True)):
        if len(set(whole[m])) == len(whole[m]):  # a micro-batch of distinct samples (a reshuffle may repeat one)
            assert not mine & theirs, m


def custom_and_refusals(rank, world_size, index):
    out = {}
    custom = {"min_difficulty": LOW, "max_difficulty": HIGH, "schedule_type": "custom"}
    engine, _, loader, _ = ds_all.initialize(model=TinyLM(), config=_config(index, schedule=custom),
                                             training_data=Sequences())
    engine.set_custom_curriculum_learning_schedule({"seqlen": lambda step: min(LOW + 4 * step, HIGH)})
    out["custom"] = [(loader.data_sampler.current_difficulties["seqlen"], max(length(i) for i in b["index"].tolist()))
                     for b, _ in zip(loader, range(3 * GAS), strict=False)]
    with pytest.raises(ValueError, match=r"no curriculum metric \['other'\]"):
        engine.set_custom_curriculum_learning_schedule({"other": lambda step: 1})
    eval_loader = engine.deepspeed_io(Sequences(), route="eval")  # evaluation reads its share in order
    out["eval"] = next(iter(eval_loader))["index"].tolist()
    engine.destroy()
    plain = _config(index)
    plain["data_efficiency"]["data_sampling"]["curriculum_learning"]["enabled"] = False
    engine, _, loader, _ = ds_all.initialize(model=TinyLM(), config=plain, training_data=Sequences())
    out["plain"] = type(loader.sampler).__name__
    for call, arg in (("set_data_post_process_func", truncate), ("set_custom_curriculum_learning_schedule", {})):
        with pytest.raises(RuntimeError) as info:
            getattr(engine, call)(arg)
        out[call] = str(info.value)
    engine.destroy()
    dynamic = _config(index)  # read by the variable-batch builder, not by the engine (as DeepSpeed's)
    dynamic["data_efficiency"]["data_sampling"]["dynamic_batching"] = {"enabled": True, "max_tokens": 64}
    engine, _, loader, _ = ds_all.initialize(model=TinyLM(), config=dynamic, training_data=Sequences())
    out["dynamic"] = type(loader.batch_sampler).__name__
    engine.destroy()
    from ds_pipe import LayerSpec, PipelineModule

    pipeline = PipelineModule([LayerSpec(nn.Linear, 4, 4), LayerSpec(nn.Linear, 4, 1)], num_stages=2,
                              loss_fn=F.mse_loss, partition_method="uniform")
    with pytest.raises(NotImplementedError) as info:
        ds_all.initialize(model=pipeline, config=_config(index))
    out["pipeline"] = str(info.value)
    return out


def test_custom_schedules_reach_the_sampler_and_what_is_off_or_not_wired_is_refused(index):
    for rank, out in enumerate(spawn(custom_and_refusals, world_size=DP, args=(index,), timeout=240)):
        for m, (current, hardest) in enumerate(out["custom"]):
            assert current == min(LOW + 4 * (m // GAS + 1), HIGH) and hardest <= current
        assert out["eval"] == [rank, rank + DP]
        assert out["plain"] == "ResumableSampler"
        for call in ("set_data_post_process_func", "set_custom_curriculum_learning_schedule"):
            assert f"engine.{call}: data_efficiency.data_sampling.curriculum_learning is off" in out[call]
        assert out["dynamic"] == "DataSampler"
        assert "data_efficiency.data_sampling.curriculum_learning with a PipelineModule" in out["pipeline"]


@pytest.mark.parametrize(("module", "name", "owner"), [
    ("curriculum_scheduler", "CurriculumScheduler", ds_data.CurriculumScheduler),
    ("data_routing.helper", "convert_to_random_ltd", ds_data.convert_to_random_ltd),
    ("data_routing.basic_layer", "RandomLayerTokenDrop", ds_data.RandomLayerTokenDrop),
    ("data_routing.scheduler", "RandomLTDScheduler", ds_data.RandomLTDScheduler),
    ("data_sampling.data_analyzer", "DataAnalyzer", ds_data.DataAnalyzer),
    ("data_sampling.data_sampler", "DeepSpeedDataSampler", ds_data.DataSampler),
    ("data_sampling.indexed_dataset", "MMapIndexedDataset", ds_data.MMapIndexedDataset),
    ("data_sampling.indexed_dataset", "MMapIndexedDatasetBuilder", ds_data.MMapIndexedDatasetBuilder),
])
def test_deepspeeds_data_pipeline_paths_are_ds_datas_classes(module, name, owner):
    assert getattr(importlib.import_module(f"ds_all.runtime.data_pipeline.{module}"), name) is owner


def test_progressive_layer_drop_path_and_what_is_not_built_is_refused_by_name():
    from ds_all.runtime.progressive_layer_drop import ProgressiveLayerDrop

    assert ProgressiveLayerDrop is ds_data.ProgressiveLayerDrop
    for module, name in (("data_routing.helper", "remove_random_ltd_state_dict"),
                         ("data_routing.scheduler", "BaseScheduler"),
                         ("data_routing.utils", "bsh_decoder_gather"),
                         ("data_sampling.data_analyzer", "DistributedDataAnalyzer"),
                         ("data_sampling.indexed_dataset", "IndexedDataset"),
                         ("data_sampling.utils", "find_fit_int_dtype")):
        path = f"ds_all.runtime.data_pipeline.{module}"
        with pytest.raises(ImportError, match=rf"deepspeed\.runtime\.data_pipeline\.{module}\.{name} \(.*\) is not "
                                              "implemented in ds-all"):
            exec(f"from {path} import {name}", {})
        with pytest.raises(AttributeError):
            assert importlib.import_module(path).no_such_name is None  # never reached: an AttributeError
    variable = importlib.import_module("ds_all.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr")
    assert variable.get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed is \
        ds_data.get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed
    assert variable.VariableBatchSizeLR is ds_data.VariableBatchSizeLR
