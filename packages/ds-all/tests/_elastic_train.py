"""A tiny elastic training script for test_elastic_launch.py, run by ds-launch on every rank.

It resumes from the latest checkpoint in ``--ckpt`` (as a DeepSpeed script does: ``load_checkpoint``;
``--load_tag`` loads that tag instead), trains to ``--steps`` optimizer steps with the batch triad the
config's ``elasticity`` section gives this world size, and saves a checkpoint after every step (not with
``--no_save``). Every step's global batch is the same data whatever the world size (drawn from the step
number), so a run's losses depend only on the weights and optimizer state it starts from. Rank 0 appends
one JSON line per step to ``--out``/``--label``.jsonl; every rank writes its pid to
``--out``/pid_restart<N>_node<CROSS_RANK>_rank<RANK> (the test kills a node's ranks with them).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn

import ds_all


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--label", default="elastic")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--load_tag", default=None)
    parser.add_argument("--no_save", action="store_true")
    parser.add_argument("--pace", type=float, default=0.0, help="seconds to sleep after each step")
    args = parser.parse_args()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "-")
    with open(os.path.join(args.out, f"pid_restart{restart}_node{os.environ['CROSS_RANK']}_rank{os.environ['RANK']}"),
              "w") as f:
        f.write(str(os.getpid()))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    engine, _, _, _ = ds_all.initialize(model=model, model_parameters=model.parameters(),
                                        config=args.deepspeed_config)
    tag, _ = engine.load_checkpoint(args.ckpt, tag=args.load_tag)
    resumed = engine.global_steps
    rank, world = dist.get_rank(), dist.get_world_size()
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    batch = engine.train_batch_size()
    while engine.global_steps < args.steps:
        step = engine.global_steps + 1
        g = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(batch, 8, generator=g), torch.randn(batch, 1, generator=g)
        total = torch.zeros(())
        for i in range(gas):
            rows = slice((i * world + rank) * micro, (i * world + rank + 1) * micro)
            loss = nn.functional.mse_loss(engine(x[rows]), y[rows])
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)
        if not args.no_save:
            engine.save_checkpoint(args.ckpt)
        if rank == 0:
            record = {"step": engine.global_steps, "loss": total.item() / (gas * world), "world": world,
                      "micro": micro, "gas": gas, "batch": batch, "restart": restart, "resumed": resumed,
                      "tag": os.path.basename(tag) if tag else None}
            with open(os.path.join(args.out, f"{args.label}.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")
        time.sleep(args.pace)
    engine.destroy()  # and the process group it created


if __name__ == "__main__":
    main()
