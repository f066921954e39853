"""A checkpoint DeepSpeed wrote for a model with non-persistent buffers (a Hugging Face BERT's ``position_ids``,
``token_type_ids``; HelloDeepSpeed's ``--load_checkpoint_dir`` on a DeepSpeed-written run) resumes on ds.
Loading follows ``load_state_dict``'s rules: a non-persistent buffer is neither saved nor expected, and keeps
the model's value. Fixtures: ``fixtures/deepspeed_checkpoints/gen_buffers.py`` (DeepSpeed 0.19.8, 2 ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ds_all
from ds_comm.testing import spawn

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed_checkpoints"
EXPECTED = torch.load(FIXTURES / "expected_buffers.pt", weights_only=True)
DATA = torch.load(FIXTURES / "expected.pt", weights_only=True)["data"]  # gen.py's batches
STEPS, MORE = 3, 2


class BufferNet(torch.nn.Module):  # gen_buffers.py's model
    def __init__(self, persistent: bool = False):
        super().__init__()
        self.fc1 = torch.nn.Linear(7, 13)
        self.norm = torch.nn.LayerNorm(13)
        self.fc2 = torch.nn.Linear(13, 5, bias=False)
        self.register_buffer("shift", torch.linspace(-0.5, 0.5, 5))
        self.register_buffer("position_ids", torch.arange(5.0), persistent=persistent)
        self.register_buffer("token_type_ids", torch.zeros(5), persistent=persistent)

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(x)))) + self.shift + 0.01 * self.position_ids + \
            self.token_type_ids


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.99], "eps": 1e-8,
                                                      "weight_decay": 0.01, "torch_adam": True}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01,
                                                         "warmup_num_steps": 10, "warmup_type": "linear"}},
            "zero_optimization": {"stage": stage}, "steps_per_print": 1000, "gradient_clipping": 1.0}


def _resume(rank, world_size, directory, stage):
    torch.manual_seed(1)  # other weights than DeepSpeed's run: the load must replace them
    engine, *_ = ds_all.initialize(model=BufferNet(), config=_config(stage))
    engine.load_checkpoint(directory)
    buffers = {n: b.clone() for n, b in engine.module.named_buffers()}
    losses = []
    for step in range(STEPS, STEPS + MORE):
        x, y = DATA[(step, rank)]
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return losses, buffers


@pytest.mark.parametrize("stage", [2, 3])
def test_a_deepspeed_checkpoint_without_non_persistent_buffers_resumes(stage):
    record = EXPECTED[f"s{stage}_buffers_fp32"]
    results = spawn(_resume, world_size=2, args=(str(FIXTURES / f"s{stage}_buffers_fp32"), stage))
    for rank, (losses, buffers) in enumerate(results):
        assert losses == pytest.approx(record["losses_after"][rank], rel=1e-6, abs=1e-7)  # DeepSpeed's after its load
        assert torch.equal(buffers["position_ids"], torch.arange(5.0))  # the model's own: not in the checkpoint
        assert torch.equal(buffers["shift"], record["saved"]["buffers"]["shift"])


def _save_then_load(rank, world_size, directory, save_persistent):
    """Save with the buffers persistent or not, then load into the model where they are not."""
    torch.manual_seed(0)
    engine, *_ = ds_all.initialize(model=BufferNet(persistent=save_persistent), config=_config(2))
    engine.module.position_ids.fill_(7.0)  # a value a load would bring back if it were saved
    engine.save_checkpoint(directory)
    engine.destroy()
    torch.manual_seed(0)
    fresh, *_ = ds_all.initialize(model=BufferNet(), config=_config(2))
    fresh.load_checkpoint(directory)
    value = fresh.module.position_ids.clone()
    fresh.destroy()
    return value


@pytest.mark.parametrize("saved_persistent", [False, True])
def test_non_persistent_buffers_are_not_saved_and_an_older_checkpoint_holding_them_loads(tmp_path, saved_persistent):
    """saved_persistent=True stands for a checkpoint of ds-zero before this rule, which saved every buffer: it still
    loads (strict), and the buffer keeps the model's value as load_state_dict would."""
    for value in spawn(_save_then_load, world_size=2, args=(str(tmp_path / "ck"), saved_persistent)):
        assert torch.equal(value, torch.arange(5.0))
