"""One rank of the exit-code test (test_exit.py), written as a training script's top level is.

    RANK=.. WORLD_SIZE=2 MASTER_ADDR=.. MASTER_PORT=.. python exit_code_rank.py EXIT_CODE

``init_distributed`` (gloo), then a ``torch.optim`` optimizer built after the group exists (its
first use imports torch._dynamo), a few training steps with all-reduces, an all-gather, and
``sys.exit(EXIT_CODE)`` with the group still alive. Its objects are module globals, freed during
interpreter shutdown, where gloo's worker threads used to abort the process.
"""

import sys

import torch

import ds_comm

ds_comm.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # after init: imports torch._dynamo
for _ in range(3):
    optimizer.zero_grad()
    model(torch.randn(4, 8)).pow(2).mean().backward()
    for p in model.parameters():
        ds_comm.all_reduce(p.grad)
    optimizer.step()
gathered = [torch.zeros(1) for _ in range(2)]
ds_comm.all_gather(gathered, torch.ones(1))
sys.exit(int(sys.argv[1]))  # the group is still alive
