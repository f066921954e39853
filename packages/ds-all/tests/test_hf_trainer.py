"""Hugging Face Transformers' ``Trainer`` on ds, the script changed by one line (``import ds_all.hf.trainer``).

On 2 ranks, GPT-2 (tied LM head) and BERT built from small configs (nothing downloaded), on synthetic data:
the Trainer's DeepSpeed path (``TrainingArguments(deepspeed=config)`` with the integration's "auto" values)
trains, evaluates, saves its checkpoints, resumes from one, and exports (``deepspeed.utils.zero_to_fp32``, or
the Trainer's own ``save_model`` under ZeRO-3 with ``stage3_gather_16bit_weights_on_model_save``). The
reference is the same Trainer run without DeepSpeed (DDP over gloo): same seed, same data order, float32, so
the losses agree within 1e-5 (the exported model's logits within 1e-4 where ds-ops' Adam kernel steps instead of
torch's AdamW); for GPT-2, so do DeepSpeed 0.19.8's own losses for the same script. And the seam itself:
metadata, the module tree, the refusals.

Each scenario runs in its own ranks (``ds_comm.testing.spawn``: fresh processes), as the seam must be
imported before Transformers; this module imports neither at its top, so the ranks load it cleanly.

CPU only: Accelerate's DeepSpeed path knows the GPUs' backends only; on a machine without one it starts
no gloo group and counts a single process (with DeepSpeed as well). ``_cpu_deepspeed_state`` builds the
state it would build on GPUs (``PartialState(backend="gloo")`` marked DeepSpeed, kept by
``accelerator_config={"use_configured_state": True}``): test set-up, not part of the user's script.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ds_comm.testing import spawn

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("accelerate") is None,
    reason="transformers and accelerate (ds-all's test extra) are not installed")

STEPS, SAVE_EVERY, MICRO, SEQ, SAMPLES = 6, 3, 4, 16, 48  # 48 samples = 6 steps of 4 × 2 ranks: one epoch
TOLERANCE = 1e-5


def _gpt2_config():
    from transformers import GPT2Config
    return GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=SEQ, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0)


def _bert_config():
    from transformers import BertConfig
    return BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                      vocab_size=64, max_position_embeddings=SEQ, num_labels=3, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0)


MODELS = {"gpt2": ("GPT2LMHeadModel", _gpt2_config), "bert": ("BertForSequenceClassification", _bert_config)}


def _data(kind: str, count: int = SAMPLES, seed: int = 1) -> list[dict]:
    import torch
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (count, SEQ), generator=generator)
    if kind == "gpt2":
        return [{"input_ids": row, "labels": row} for row in ids]
    labels = torch.randint(0, 3, (count,), generator=generator)
    return [{"input_ids": row, "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": label}
            for row, label in zip(ids, labels, strict=True)]


def _cpu_deepspeed_state() -> None:
    """The Accelerate state its DeepSpeed path makes on GPUs, made on CPU (see the module docstring)."""
    from accelerate.state import AcceleratorState, PartialState
    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    try:
        PartialState(backend="gloo")
    finally:
        del os.environ["ACCELERATE_USE_DEEPSPEED"]


def _trainer(kind: str, output_dir: str, init_dir: str, deepspeed: dict | None):
    import transformers
    from transformers import Trainer, TrainingArguments
    if deepspeed is not None:
        _cpu_deepspeed_state()
    # the arguments first: under ZeRO-3 they keep the HfDeepSpeedConfig alive that makes from_pretrained
    # build the model partitioned (zero.Init) and load rank 0's weights into it (GatheredParameters)
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=MICRO, per_device_eval_batch_size=MICRO,
                             max_steps=STEPS, learning_rate=1e-3, weight_decay=0.01, max_grad_norm=1.0,
                             logging_steps=1, save_steps=SAVE_EVERY, seed=0, report_to=[], disable_tqdm=True,
                             dataloader_num_workers=0, deepspeed=deepspeed, use_cpu=deepspeed is None,
                             accelerator_config={"use_configured_state": deepspeed is not None})
    model = getattr(transformers, MODELS[kind][0]).from_pretrained(init_dir)
    return Trainer(model=model, args=args, train_dataset=_data(kind), eval_dataset=_data(kind, 8, seed=2)), model


def _losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _scenario(rank: int, world_size: int, kind: str, config: dict, root: str) -> dict:
    import ds_all.hf.trainer  # isort: skip  (the one line a Trainer script adds, before transformers)
    import deepspeed  # what Transformers and Accelerate import: ds_all
    import torch
    import transformers
    from transformers.integrations import is_deepspeed_zero3_enabled

    import ds_all
    assert deepspeed is ds_all
    init_dir = os.path.join(root, "init")
    if rank == 0:  # the "pretrained" model both runs start from
        torch.manual_seed(0)
        getattr(transformers, MODELS[kind][0])(MODELS[kind][1]()).save_pretrained(init_dir)
    torch.distributed.barrier()
    out: dict = {}

    # the reference: the same Trainer run without DeepSpeed (DDP)
    trainer, _ = _trainer(kind, os.path.join(root, "ddp"), init_dir, None)
    trainer.train()
    out["ddp_losses"], out["ddp_eval"] = _losses(trainer), trainer.evaluate()["eval_loss"]
    trainer.save_model(os.path.join(root, "ddp_final"))

    # on ds, through the Trainer's DeepSpeed path
    trainer, model = _trainer(kind, os.path.join(root, "ds"), init_dir, config)
    zero3 = config["zero_optimization"]["stage"] == 3
    out["zero3_enabled"] = is_deepspeed_zero3_enabled()
    # under ZeRO-3 the model was built partitioned: each rank holds a slice, the full shape is ds_shape
    out["partitioned"] = zero3 and all(p.numel() == 0 or p.numel() < p.ds_numel for p in model.parameters())
    trainer.train()
    out["ds_losses"], out["ds_eval"] = _losses(trainer), trainer.evaluate()["eval_loss"]
    out["engine"] = type(trainer.model_wrapped).__module__ + "." + type(trainer.model_wrapped).__name__
    if zero3:  # the Trainer's own export: whole 16-bit (here fp32) weights gathered on rank 0
        trainer.save_model(os.path.join(root, "ds_final"))
    del trainer, model

    # resume from the Trainer's checkpoint in a new Trainer (a new model, the optimizer and schedule from it)
    trainer, _ = _trainer(kind, os.path.join(root, "resumed"), init_dir, config)
    trainer.train(resume_from_checkpoint=os.path.join(root, "ds", f"checkpoint-{SAVE_EVERY}"))
    out["resumed_losses"] = _losses(trainer)
    return out


def _logits(kind: str, model, batch: list[dict]):
    import torch
    inputs = {k: torch.stack([row[k] for row in batch]) for k in batch[0] if k != "labels"}
    with torch.no_grad():
        return model.eval()(**inputs).logits


def _check(kind: str, results: list[dict], root: Path, export: str) -> None:
    import torch
    import transformers
    for result in results:  # the ranks agree
        assert result == results[0]
    result = results[0]
    assert len(result["ddp_losses"]) == STEPS and len(result["ds_losses"]) == STEPS
    assert result["ds_losses"] == pytest.approx(result["ddp_losses"], abs=TOLERANCE, rel=0)
    assert result["ds_eval"] == pytest.approx(result["ddp_eval"], abs=TOLERANCE, rel=0)
    assert result["ddp_losses"][0] != pytest.approx(result["ddp_losses"][-1], abs=1e-3)  # it does train
    # the resumed run continues from step SAVE_EVERY with what the uninterrupted run had (its log history
    # holds the first SAVE_EVERY losses, read from the checkpoint, then the ones it computed)
    assert result["resumed_losses"] == pytest.approx(result["ds_losses"], abs=TOLERANCE, rel=0)
    assert result["engine"] == "ds_all._engine.DeepSpeedEngine"

    cls = getattr(transformers, MODELS[kind][0])
    batch = _data(kind, 8, seed=3)
    # the model the Trainer saved in its last checkpoint (gathered at stage 3: stage3_gather_16bit_weights_on_model_save)
    saved = _logits(kind, cls.from_pretrained(root / "ds" / f"checkpoint-{STEPS}"), batch)
    if export == "zero_to_fp32":  # DeepSpeed's deepspeed.utils.zero_to_fp32, on the Trainer's last checkpoint
        from ds_all.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        state = get_fp32_state_dict_from_zero_checkpoint(root / "ds" / f"checkpoint-{STEPS}")
        model = cls(MODELS[kind][1]())
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding: one tensor
        model.tie_weights()
        exported = model
    else:  # the Trainer's save_model under ZeRO-3, read back by from_pretrained
        exported = cls.from_pretrained(root / "ds_final")
    torch.testing.assert_close(_logits(kind, exported, batch), saved, atol=1e-6, rtol=0)
    # and the weights are DDP's, up to the roundings of ds-ops' Adam kernel (the config's AdamW, DeepSpeedCPUAdam
    # under offload) where DDP steps torch's AdamW: the last bits of each update differ (the losses above agree
    # within 1e-5; the logits after 6 steps differed by 1.9e-5 at most)
    expected = _logits(kind, cls.from_pretrained(root / "ddp_final"), batch)
    torch.testing.assert_close(saved, expected, atol=1e-4, rtol=0)


# The first scenario below (GPT-2, ZeRO-2, the AdamW section) run by DeepSpeed 0.19.8 itself with the same
# Trainer script (Transformers 5.24, Accelerate 1.15, DS_ACCELERATOR=cpu, 2 ranks, the same Accelerate state
# set-up): its logged losses. Its ZeRO-3 run gave the same but 3.8999650478363037 at step 5.
DEEPSPEED_0_19_8_LOSSES = [3.882498264312744, 3.9174160957336426, 3.896160364151001, 3.9261980056762695,
                           3.899965286254883, 3.921757221221924]
# The third (GPT-2, ZeRO-3, the Trainer's torch AdamW), the same way (ds gave these bit for bit).
DEEPSPEED_0_19_8_ZERO3_LOSSES = [3.882498264312744, 3.917416572570801, 3.89616060256958, 3.926198959350586,
                                 3.899965286254883, 3.921757936477661]

GUIDE_AUTO = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}


def test_gpt2_zero2_trainer_with_the_configs_optimizer_exported_with_zero_to_fp32(tmp_path):
    """The guide's ZeRO-2 config: an ``AdamW`` optimizer section whose values are "auto" (the Trainer's
    DummyOptim path; its linear schedule is built on ds's optimizer through the callable DeepSpeed takes)."""
    config = {**GUIDE_AUTO, "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                        "weight_decay": "auto"}}}
    results = spawn(_scenario, world_size=2, args=("gpt2", config, str(tmp_path)), timeout=240)
    assert not results[0]["zero3_enabled"]
    assert results[0]["ds_losses"] == pytest.approx(DEEPSPEED_0_19_8_LOSSES, abs=TOLERANCE, rel=0)
    _check("gpt2", results, tmp_path, "zero_to_fp32")


def test_bert_zero3_with_optimizer_offload_built_under_zero_init_exported_by_save_model(tmp_path):
    """ZeRO-3 with the optimizer offloaded to the CPU and the Trainer's own AdamW (Accelerate maps it to
    ``deepspeed.ops.adam.DeepSpeedCPUAdam``); the model is built partitioned by ``from_pretrained``."""
    config = {**GUIDE_AUTO, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu"}, "stage3_gather_16bit_weights_on_model_save": True,
        "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto"}}
    results = spawn(_scenario, world_size=2, args=("bert", config, str(tmp_path)), timeout=240)
    assert results[0]["zero3_enabled"] and results[0]["partitioned"]
    _check("bert", results, tmp_path, "save_model")


def test_gpt2_zero3_tied_lm_head_exported_with_zero_to_fp32_and_save_model(tmp_path):
    """ZeRO-3 with the Trainer's own AdamW and scheduler (no optimizer section): GPT-2's LM head is its
    embedding, used by two modules: both exports load into a GPT-2 with the trained weights."""
    config = {**GUIDE_AUTO, "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}
    results = spawn(_scenario, world_size=2, args=("gpt2", config, str(tmp_path)), timeout=240)
    assert results[0]["zero3_enabled"] and results[0]["partitioned"]
    assert results[0]["ds_losses"] == pytest.approx(DEEPSPEED_0_19_8_ZERO3_LOSSES, abs=TOLERANCE, rel=0)
    _check("gpt2", results, tmp_path, "zero_to_fp32")
    _check("gpt2", results, tmp_path, "save_model")


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=200)


def test_deepspeed_is_ds_all_with_metadata_in_this_process_only(tmp_path):
    """Under ``ds-launch --deepspeed_alias`` too (its folder first on the ranks' PYTHONPATH): the two agree."""
    script = tmp_path / "train.py"
    script.write_text("")
    plan = subprocess.run([sys.executable, "-m", "ds_launch", "--deepspeed_alias", "--dry_run", str(script)],
                          capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    pythonpath = re.search(r"PYTHONPATH=(\S+)", plan.stdout).group(1)  # what the ranks would get
    done = _python("""
        import importlib.metadata, importlib.util, json, os, subprocess, sys
        import ds_all.hf.trainer
        import deepspeed, deepspeed.comm, deepspeed.utils.zero_to_fp32, deepspeed.runtime.zero.partition_parameters
        import ds_all, ds_all.comm, ds_all.utils.zero_to_fp32
        from transformers.integrations.deepspeed import is_deepspeed_available
        from accelerate.utils import is_deepspeed_available as accelerate_sees
        from accelerate.utils.versions import compare_versions
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # without the launcher's alias
        other = subprocess.run([sys.executable, "-c", "import importlib.util; print(importlib.util.find_spec('deepspeed'))"],
                               capture_output=True, text=True, env=env).stdout.strip()
        print(json.dumps({
            "same": [deepspeed is ds_all, deepspeed.comm is ds_all.comm,
                     deepspeed.utils.zero_to_fp32 is ds_all.utils.zero_to_fp32],
            "spec": ds_all.comm.__spec__.name, "version": importlib.metadata.version("deepspeed"),
            "summary": importlib.metadata.metadata("deepspeed")["Summary"],
            "transformers": is_deepspeed_available(), "accelerate": accelerate_sees(),
            "at_least": compare_versions("deepspeed", ">=", "0.16.4"), "other_process": other}))
    """, PYTHONPATH=pythonpath)
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record["same"] == [True, True, True] and record["spec"] == "ds_all.comm"
    assert record["version"] == "0.19.8" and record["summary"].startswith("ds-all ")
    assert record["transformers"] is True and record["accelerate"] is True and record["at_least"] is True
    assert record["other_process"] == "None"  # nothing installed: another interpreter finds no deepspeed


def test_refused_where_a_real_deepspeed_is_importable(tmp_path):
    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "__init__.py").write_text("__version__ = '0.19.8'\n")
    done = _python("import ds_all.hf.trainer", PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    assert done.returncode == 1
    assert "ImportError: ds_all.hf.trainer: a real DeepSpeed is installed" in done.stderr
    assert str(tmp_path / "deepspeed" / "__init__.py") in done.stderr


def test_refused_after_accelerate_decided_there_is_no_deepspeed():
    done = _python("import accelerate.utils\nimport ds_all.hf.trainer")
    assert done.returncode == 1
    assert "RuntimeError: ds_all.hf.trainer was imported after accelerate.utils.imports" in done.stderr
    assert "put `import ds_all.hf.trainer` before the imports of transformers and accelerate" in done.stderr



def test_engine_config_answers_the_dict_reads_of_transformers_and_accelerate():
    import ds_all
    config = ds_all.Config.load({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3},
                                 "steps_per_print": float("inf")})  # Accelerate writes inf: never print
    assert config.get("zero_optimization", {}).get("stage") == 3 and config["train_micro_batch_size_per_gpu"] == 4
    assert "zero_optimization" in config and "optimizer" not in config and config.get("optimizer") is None
    assert config.steps_per_print >= 2**62  # no step count reaches it
    with pytest.raises(ValueError, match="steps_per_print"):
        ds_all.Config.load({"train_micro_batch_size_per_gpu": 4, "steps_per_print": 2.5})


def test_clone_tensors_for_torch_save_and_the_tensor_constructor_wrapper():
    import torch

    from ds_all.checkpoint.utils import clone_tensors_for_torch_save
    from ds_all.runtime.zero.partition_parameters import zero_wrapper_for_fp_tensor_constructor
    buffer = torch.arange(12.0)
    item = {"a": [buffer[:4], (buffer[4:8], 3)], "b": "text"}
    copy = clone_tensors_for_torch_save(item)
    assert type(copy["a"][1]) is tuple and copy["b"] == "text" and copy["a"][1][1] == 3
    for mine, theirs in ((copy["a"][0], buffer[:4]), (copy["a"][1][0], buffer[4:8])):
        assert torch.equal(mine, theirs) and mine.untyped_storage().nbytes() == 16  # its own 4 floats, not the buffer
    assert zero_wrapper_for_fp_tensor_constructor(torch.ones, torch.float16)(3).dtype == torch.float16
    assert zero_wrapper_for_fp_tensor_constructor(torch.arange, torch.float16)(3).dtype == torch.int64
