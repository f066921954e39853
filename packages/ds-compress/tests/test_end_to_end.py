"""8-bit weights + 50% sparse pruning train to within 2 points of the uncompressed model."""

import time

import torch
from torch import nn

from ds_compress import CompressionScheduler, init_compression, redundancy_clean

CONFIG = {
    "weight_quantization": {
        "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True, "schedule_offset": 0},
        "different_groups": {"wq": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["net"]}},
    },
    "sparse_pruning": {
        "shared_parameters": {"enabled": True, "schedule_offset": 100, "method": "l1"},
        "different_groups": {"sp": {"params": {"dense_ratio": 0.5}, "modules": ["net"]}},
    },
}


def _task(n, generator):
    x = torch.randn(n, 16, generator=generator)
    w = torch.randn(16, 4, generator=torch.Generator().manual_seed(123))
    y = (x @ w + 0.3 * x[:, :4] ** 2).argmax(dim=1)  # mildly nonlinear, learnable
    return x, y


def _model():
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = _model()

    def forward(self, x):
        return self.net(x)


def _train(model, x, y, scheduler=None, steps=300):
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(steps):
        idx = torch.arange(step * 128, step * 128 + 128) % len(x)
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
    return model


@torch.no_grad()
def _accuracy(model, x, y):
    return model(x).argmax(dim=1).eq(y).float().mean().item()


def test_compressed_training_matches_uncompressed_accuracy():
    start = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    x, y = _task(4096, g)
    xt, yt = _task(2048, g)
    torch.manual_seed(1)
    baseline = _train(Wrapper(), x, y)
    torch.manual_seed(1)
    model = init_compression(Wrapper(), CONFIG)
    _train(model, x, y, CompressionScheduler(model, CONFIG))
    acc_base, acc_comp = _accuracy(baseline, xt, yt), _accuracy(model, xt, yt)
    print(f"accuracy: uncompressed {acc_base:.4f}, 8-bit + 50% sparse {acc_comp:.4f}")
    assert acc_base > 0.85, acc_base  # the task is learnable
    assert acc_comp >= acc_base - 0.02, (acc_base, acc_comp)
    redundancy_clean(model, CONFIG)
    assert _accuracy(model, xt, yt) == acc_comp  # clean is the same function
    for layer in (model.net[0], model.net[2], model.net[4]):
        w = layer.stored_weight()
        assert abs((w == 0).float().mean().item() - 0.5) <= 1 / w.numel()
        assert isinstance(layer.weight, nn.Parameter)  # DeepSpeed's clean: float weights on the 8-bit grid
        assert torch.unique(w).numel() <= 2 ** 8
    assert time.perf_counter() - start < 60
