"""A tiny training script for test_autotuning*.py, run on every rank by ds-launch (under ds-autotune).

    _autotune_train.py --deepspeed_config cfg.json [--steps N] [--done PATH]

Trains a 2-layer MLP on fixed random data; with the config's ``autotuning.enabled`` the engine profiles
and exits by itself after ``end_profile_step`` + 1; otherwise after ``--steps`` steps rank 0 writes
``--done`` (the final loss and batch sizes) — what ``ds-autotune run`` training leaves behind.
"""

import argparse
import json

import torch
from torch import nn

import ds_all

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--done", default=None)
parser.add_argument("--local_rank", type=int, default=0)
ds_all.add_config_arguments(parser)
args = parser.parse_args()

torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
engine, _, _, _ = ds_all.initialize(args=args, model=model, model_parameters=model.parameters())
micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
data = torch.randn(64, 32, generator=torch.Generator().manual_seed(1 + engine.global_rank))
loss = None
for step in range(args.steps):
    for m in range(gas):
        rows = torch.arange(step * gas + m, step * gas + m + micro) % len(data)
        x = data[rows]
        loss = ((engine(x) - x) ** 2).mean()
        engine.backward(loss)
        engine.step()
if args.done and engine.global_rank == 0:
    with open(args.done, "w") as f:
        json.dump({"loss": float(loss), "steps": engine.global_steps, "micro": micro, "gas": gas,
                   "stage": engine.zero_optimization_stage()}, f)
engine.destroy()
