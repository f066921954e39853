"""ds-zero in a plain loop, without the engine: a tiny model trained with ZeRO stage 2 on gloo.

    ds-launch --num_procs 2 examples/train_zero_plain.py [--steps 30] [--lr 0.1]

Every rank builds the same model (same seed) and a different shard of a synthetic regression
problem. ds-comm starts the process group from what ds-launch sets (RANK, WORLD_SIZE, ...);
`ds_zero.ZeroOptimizer` partitions the optimizer states and gradients (reduce-scattered bucket by
bucket as backward produces them) and all-gathers the updated parameters, so the ranks stay
identical; the comms logger records every collective and rank 0 prints its summary at the end.
Rank 0 prints the global loss per step and whether it went down. Exit code 1 if it did not, or if
the ranks' parameters drifted apart.
"""

from __future__ import annotations

import argparse
import sys

import torch

import ds_comm
from ds_zero import ZeroOptimizer


def make_data(rank: int, world_size: int, samples: int = 256, features: int = 8):
    generator = torch.Generator().manual_seed(1234)
    true_weight = torch.randn(features, 1, generator=generator)
    x = torch.randn(samples, features, generator=generator)
    y = torch.tanh(x @ true_weight) + 0.01 * torch.randn(samples, 1, generator=generator)
    return x[rank::world_size], y[rank::world_size]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--local_rank", type=int, default=0)  # passed by ds-launch
    args = parser.parse_args()

    # ds-comm first, then the model and optimizer, in the natural order: init_distributed makes it
    # safe to build an optimizer after the process group exists (with plain torch.distributed on
    # gloo, that order could abort a rank at exit).
    ds_comm.init_distributed(dist_backend="gloo")
    ds_comm.configure(enabled=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    zero = ZeroOptimizer(model, torch.optim.SGD, optimizer_kwargs={"lr": args.lr}, config={"stage": 2})
    rank, world = ds_comm.get_rank(), ds_comm.get_world_size()
    x, y = make_data(rank, world)

    losses = []
    for step in range(args.steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        zero.backward(loss)
        zero.step()
        zero.zero_grad()
        global_loss = loss.detach().clone()
        ds_comm.all_reduce(global_loss)
        losses.append(global_loss.item() / world)
        if rank == 0:
            print(f"step {step:3d}  loss {losses[-1]:.5f}", flush=True)

    checksum = torch.cat([p.detach().flatten() for p in model.parameters()]).sum().reshape(1)
    gathered = torch.zeros(world)
    ds_comm.all_gather_into_tensor(gathered, checksum)
    in_sync = bool((gathered == gathered[0]).all())
    ds_comm.log_summary()
    ds_comm.destroy_process_group()

    went_down = losses[-1] < 0.5 * losses[0]
    if rank == 0:
        print(f"ranks {world}, parameters identical on every rank: {in_sync}")
        verdict = "went down" if went_down else "did NOT go down"
        print(f"loss {verdict}: {losses[0]:.5f} -> {losses[-1]:.5f}")
    return 0 if went_down and in_sync else 1


if __name__ == "__main__":
    sys.exit(main())
