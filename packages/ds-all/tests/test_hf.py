"""A real client: Hugging Face GPT-2 and BERT (built from small configs, nothing downloaded) trained
under ``ds_all.initialize`` with ZeRO-2 and ZeRO-3 on 2 ranks (GPT-2's tied LM head: a parameter two
modules share); their loss curves equal a plain PyTorch loop's on
the same data (fp32, 1e-5). And ``ds_all.hf.resolve_auto``: each "auto" of the integration guide
filled from TrainingArguments' fields, conflicts listed, missing inputs named."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import ds_all
from ds_comm.testing import spawn

ARGS = SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=1.0,
                       learning_rate=3e-4, adam_beta1=0.9, adam_beta2=0.98, adam_epsilon=1e-6, weight_decay=0.1,
                       warmup_steps=0.1, fp16=False, bf16=True)

GUIDE_ZERO3 = {  # the integration guide's ZeRO-3 example, "auto" wherever it writes it
    "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def test_every_auto_of_the_guide_gets_the_trainers_value():
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=64))
    out = ds_all.hf.resolve_auto(GUIDE_ZERO3, ARGS, model=model, num_training_steps=200, world_size=2)
    assert out["train_micro_batch_size_per_gpu"] == 4 and out["gradient_accumulation_steps"] == 2
    assert out["train_batch_size"] == 16 and out["gradient_clipping"] == 1.0
    assert out["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.9, 0.98], "eps": 1e-6, "weight_decay": 0.1}
    assert out["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 20,
                                          "total_num_steps": 200}
    assert out["fp16"] == {"enabled": False} and out["bf16"] == {"enabled": True}
    zero = out["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
            zero["stage3_param_persistence_threshold"]) == (4096, 3686, 640)
    assert GUIDE_ZERO3["optimizer"]["params"]["lr"] == "auto"  # the input is not modified
    resolved = ds_all.Config.load(out).resolve(dp_world_size=2)  # nothing "auto" is left
    assert resolved.train_batch_size == 16


def test_explicit_values_that_disagree_are_all_listed():
    config = {**GUIDE_ZERO3, "train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.5,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.999]}}}
    with pytest.raises(ValueError) as error:
        ds_all.hf.resolve_auto(config, ARGS, hidden_size=64, num_training_steps=200, world_size=2)
    text = str(error.value)
    assert "train_micro_batch_size_per_gpu: is 8 in the config but the arguments give 4" in text
    assert "gradient_clipping: is 0.5 in the config but the arguments give 1.0 (max_grad_norm)" in text
    assert "optimizer.params.betas: is [0.9, 0.999] in the config but the arguments give [0.9, 0.98]" in text
    assert "optimizer.params.lr" not in text  # agrees


def test_an_auto_whose_input_is_missing_is_named():
    with pytest.raises(ValueError) as error:
        ds_all.hf.resolve_auto(GUIDE_ZERO3, ARGS, world_size=2)
    text = str(error.value)
    assert 'zero_optimization.reduce_bucket_size: is "auto" and needs hidden_size²' in text
    assert 'scheduler.params.total_num_steps: is "auto" and needs num_training_steps=' in text
    assert 'scheduler.params.warmup_num_steps: is "auto" and needs warmup_steps, or warmup_ratio' in text


def test_transformers_training_arguments_are_read_as_the_trainer_reads_them(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="TrainingArguments needs accelerate (pip install accelerate)")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2,
                                          gradient_accumulation_steps=3, learning_rate=1e-3, warmup_steps=5,
                                          report_to=[], use_cpu=True)
    out = ds_all.hf.resolve_auto(GUIDE_ZERO3, args, hidden_size=8, num_training_steps=50, world_size=1)
    assert (out["train_batch_size"], out["scheduler"]["params"]["warmup_num_steps"]) == (6, 5)


# --------------------------------------------------------------------------- real models, 2 ranks
STEPS, MICRO, SEQ, VOCAB = 4, 2, 16, 96


def _model(kind: str):
    import transformers

    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=SEQ, vocab_size=VOCAB,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                     vocab_size=VOCAB, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(config)


def _inputs(step: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(100 * (step % 2) + rank)  # two batches per rank, seen in turn
    ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids}


def hf_model_under_zero(rank, world_size, kind, stage):
    model, twin = _model(kind), _model(kind)
    config = ds_all.hf.resolve_auto(
        {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
         "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                   "weight_decay": "auto", "torch_adam": True}},
         "zero_optimization": {"stage": stage, "reduce_bucket_size": "auto",
                               **({"stage3_param_persistence_threshold": "auto"} if stage == 3 else {})}},
        SimpleNamespace(**{**vars(ARGS), "per_device_train_batch_size": MICRO, "gradient_accumulation_steps": 1}),
        model=model)
    engine, *_ = ds_all.initialize(model=model, config=config)
    reference = torch.optim.AdamW(twin.parameters(), lr=3e-4, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.1)
    ours, plain = [], []
    for step in range(STEPS):
        loss = engine(**_inputs(step, rank)).loss
        engine.backward(loss)
        engine.step()
        ours.append(loss.item())
        reference.zero_grad()
        for r in range(world_size):  # the plain loop: the mean gradient of both ranks' batches
            twin_loss = twin(**_inputs(step, r)).loss
            (twin_loss / world_size).backward()
            if r == rank:
                plain.append(twin_loss.item())
        torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
        reference.step()
    engine.destroy()
    return ours, plain


@pytest.mark.parametrize("kind, stage", [("gpt2", 2), ("bert", 2), ("gpt2", 3), ("bert", 3)])
def test_a_transformers_model_trains_under_zero_as_in_a_plain_loop(kind, stage):
    pytest.importorskip("transformers")
    for ours, plain in spawn(hf_model_under_zero, world_size=2, args=(kind, stage), timeout=240):
        assert ours == pytest.approx(plain, rel=1e-5, abs=1e-5)
        assert ours[2] < ours[0] and ours[3] < ours[1]  # each batch's loss falls


def hf_checkpoint_under_zero_3(rank, world_size, path):
    model = _model("gpt2")
    config = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = ds_all.initialize(model=model, config=config)
    for step in range(3):
        engine.backward(engine(**_inputs(step, rank)).loss)
        engine.step()
    engine.save_checkpoint(path)
    with torch.no_grad():
        logits = engine(input_ids=_inputs(5, 0)["input_ids"]).logits
    engine.destroy()
    return logits


def test_a_transformers_model_round_trips_through_the_safetensors_export_into_from_pretrained(tmp_path, monkeypatch):
    """GPT-2 (its LM head tied to the embedding) trained under ZeRO-3 on 2 ranks, exported by
    ds-zero-to-fp32 --safetensors in shards with an index, loaded by from_pretrained: the same logits."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    import subprocess
    import sys

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    logits = spawn(hf_checkpoint_under_zero_3, world_size=2, args=(str(tmp_path / "ck"),), timeout=240)[0]
    out = tmp_path / "hf"
    out.mkdir()
    export = subprocess.run([sys.executable, "-m", "ds_zero._export", str(tmp_path / "ck"), str(out / "model.safetensors"),
                             "--safetensors", "--max_shard_size", "40KB"], capture_output=True, text=True, timeout=120)
    assert export.returncode == 0, export.stdout + export.stderr
    assert (out / "model.safetensors.index.json").exists() and len(list(out.glob("model-*.safetensors"))) > 1
    _model("gpt2").config.save_pretrained(out)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # tied again, as Hugging Face saves it
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=_inputs(5, 0)["input_ids"]).logits, logits)
