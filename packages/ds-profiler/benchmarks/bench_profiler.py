"""Profiling overhead: a forward with ds_profiler active against a plain forward, same process.

Models: the GPT-style model of the tests (4 layers, h=256, s=128, batch 4) and a small conv net
(4 conv+BN+ReLU stages on 64x64 images, batch 16). Plain and profiled forwards alternate, under
``torch.no_grad()``, and the medians are compared; the goal is a ratio <= 1.3. For reference the
same forward under ``torch.utils.flop_counter.FlopCounterMode`` (torch's own counter, matmul and
convolution flops only, no per-module latency) is timed as well.

    python benchmarks/bench_profiler.py [--repeats 20] [--device cpu|cuda] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ds_profiler import FlopsProfiler

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _models import GPT  # the tests' model: the benchmark profiles what the tests check

GOAL = 1.3


class ConvNet(nn.Module):
    def __init__(self, widths=(32, 64, 128, 128), classes=100) -> None:
        super().__init__()
        layers, c_in = [], 3
        for i, width in enumerate(widths):
            layers += [nn.Conv2d(c_in, width, 3, stride=1 if i == 0 else 2, padding=1, bias=False),
                       nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
            c_in = width
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(device, fn) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def measure(name: str, model: nn.Module, x: torch.Tensor, repeats: int, device: torch.device) -> dict:
    model = model.to(device).eval()
    x = x.to(device)
    plain, profiled, counter = [], [], []
    prof = FlopsProfiler(model)
    with torch.no_grad():
        for _ in range(3):  # warm-up: allocator, kernels, and the profiler's own first call
            model(x)
            prof.start_profile()
            model(x)
            prof.stop_profile()
        for _ in range(repeats):  # alternate, so that load from elsewhere hits all three alike
            plain.append(_timed(device, lambda: model(x)))
            prof.start_profile()
            profiled.append(_timed(device, lambda: model(x)))
            prof.stop_profile()
            flops = prof.get_total_flops()
            with FlopCounterMode(display=False) as flop_counter:
                counter.append(_timed(device, lambda: model(x)))
    prof.end_profile()
    plain_s, profiled_s, counter_s = (statistics.median(v) for v in (plain, profiled, counter))
    return {
        "model": name, "plain_ms": plain_s * 1e3, "profiled_ms": profiled_s * 1e3,
        "ratio": profiled_s / plain_s, "flop_counter_mode_ms": counter_s * 1e3,
        "flop_counter_mode_ratio": counter_s / plain_s, "flops": flops,
        "torch_counter_flops": flop_counter.get_total_flops(), "gflops_per_s": flops / plain_s / 1e9,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    b, s = 4, 128
    cases = [
        (f"gpt L4 h256 b{b} s{s}", GPT(vocab=1024, seq=s, h=256, heads=8, layers=4),
         torch.randint(0, 1024, (b, s))),
        ("convnet b16 64x64", ConvNet(), torch.randn(16, 3, 64, 64)),
    ]
    results = [measure(name, model, x, args.repeats, device) for name, model, x in cases]
    print(f"device: {device} ({torch.get_num_threads()} threads), torch {torch.__version__}, "
          f"medians of {args.repeats} alternating runs")
    header = f"{'model':<24} {'plain ms':>9} {'ds_profiler ms':>15} {'ratio':>6} {'FlopCounterMode ms':>19} {'ratio':>6} {'GFLOPS':>7}"
    print(header)
    for r in results:
        print(f"{r['model']:<24} {r['plain_ms']:>9.2f} {r['profiled_ms']:>15.2f} {r['ratio']:>6.3f} "
              f"{r['flop_counter_mode_ms']:>19.2f} {r['flop_counter_mode_ratio']:>6.3f} {r['gflops_per_s']:>7.1f}")
    worst = max(r["ratio"] for r in results)
    print(f"goal: ds_profiler / plain <= {GOAL}: {'met' if worst <= GOAL else 'NOT met'} (worst {worst:.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(device), "torch": torch.__version__, "goal_ratio": GOAL,
                                               "repeats": args.repeats, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
