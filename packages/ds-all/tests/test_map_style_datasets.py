"""DeepSpeed hands ``training_data`` to a DataLoader: any map-style dataset trains, not only a torch Dataset.
The ZenFlow Llama fine-tune passes a Hugging Face ``datasets.Dataset`` (no torch base class; rows as dicts;
``__getitems__`` for a batch of rows). ``HFLikeDataset`` has exactly that surface."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ds_all
from ds_comm.testing import spawn


class HFLikeDataset:
    """The surface of ``datasets.Dataset`` a DataLoader touches: ``__len__``, ``__getitem__`` (a row as a dict of
    Python values) and ``__getitems__`` (a list of rows), and no torch base class."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(3)
        self.x, self.y = torch.randn(n, 4, generator=g).tolist(), torch.randn(n, 1, generator=g).tolist()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i]}

    def __getitems__(self, keys: list[int]) -> list[dict]:
        return [self[i] for i in keys]


def _collate(rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([r["x"] for r in rows]), torch.tensor([r["y"] for r in rows])


class AsRows(torch.utils.data.Dataset):
    """The same rows through a torch Dataset."""

    def __init__(self, n: int):
        self.rows = HFLikeDataset(n)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _train(rank, world_size, kind):
    dataset = HFLikeDataset(32) if kind == "hf" else AsRows(32)  # made here: a test module's class does not pickle
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "steps_per_print": 1000}
    engine, _, loader, _ = ds_all.initialize(model=model, config=config, training_data=dataset,
                                             collate_fn=_collate)
    seen, losses = [], []
    for x, y in loader:
        seen.append(x)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return torch.cat(seen), losses


def test_a_hugging_face_style_dataset_trains_as_a_torch_one():
    ours = spawn(_train, world_size=2, args=("hf",))
    reference = spawn(_train, world_size=2, args=("torch",))
    for (seen, losses), (ref_seen, ref_losses) in zip(ours, reference, strict=True):
        assert len(losses) == 4 and torch.equal(seen, ref_seen) and losses == ref_losses
    assert not torch.equal(ours[0][0], ours[1][0])  # each rank its own share


def _refused(rank, world_size):
    config = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    with pytest.raises(ValueError) as refused:
        ds_all.initialize(model=nn.Linear(2, 1), config=config, training_data=iter([1, 2]))
    return str(refused.value)


def test_what_is_not_a_map_style_dataset_is_named():
    message = spawn(_refused, world_size=1)[0]
    assert "map-style dataset (with __len__ and __getitem__" in message and "got list_iterator" in message
