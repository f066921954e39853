#!/usr/bin/env python3
# ruff: noqa: B007  (the example's code, kept as DeepSpeedExamples writes it)
"""DeepSpeedExamples' training/pipeline_parallelism/train.py, adapted only for a CPU without internet:
torchvision is not installed, so the model is an AlexNet of torchvision's structure (``features``,
``avgpool``, ``classifier`` with its dropouts, joined into a `PipelineModule` exactly as the example joins
them) shrunk to 32x32 images, and CIFAR-10 is random tensors of its shape; gloo instead of nccl, a few
steps, and the losses ``train_batch()`` returns written as JSON. The import is the one line a user changes:
``DS_EXAMPLE_BACKEND=deepspeed`` runs it on DeepSpeed itself (how ``pipeline_losses.json`` was made),
anything else on ds.

    ds-launch --num_procs 2 train.py --deepspeed_config ds_config.json -p 2 --steps 3
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn

if os.environ.get("DS_EXAMPLE_BACKEND") == "deepspeed":
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.pipe import PipelineModule
    from deepspeed.utils import RepeatingLoader
else:
    import ds_all as deepspeed
    from ds_all.accelerator import get_accelerator
    from ds_all.pipe import PipelineModule
    from ds_all.utils import RepeatingLoader


class AlexNet(nn.Module):
    """torchvision.models.AlexNet's layers, its widths shrunk for 3x32x32 images."""

    def __init__(self, num_classes=1000, dropout=0.5):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, kernel_size=3, stride=1, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2, stride=2),
            nn.Conv2d(16, 32, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2, stride=2),
            nn.Conv2d(32, 48, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(48, 32, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(32, 32, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout),
            nn.Linear(32 * 2 * 2, 256),
            nn.ReLU(inplace=True),
            nn.Dropout(p=dropout),
            nn.Linear(256, 256),
            nn.ReLU(inplace=True),
            nn.Linear(256, num_classes),
        )

    def forward(self, x):
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


def cifar_trainset(local_rank, samples):
    """CIFAR-10's shapes (3x32x32 images, 10 classes), random; the same on every rank."""
    # Ensure only one rank downloads (the example's semaphore, kept: nothing is downloaded here).
    dist.barrier()
    if local_rank != 0:
        dist.barrier()
    g = torch.Generator().manual_seed(1234)
    images = torch.randn(samples, 3, 32, 32, generator=g)
    trainset = torch.utils.data.TensorDataset(images, torch.randint(0, 10, (samples,), generator=g))
    if local_rank == 0:
        dist.barrier()
    return trainset


def get_args():
    parser = argparse.ArgumentParser(description='CIFAR')
    parser.add_argument('--local_rank', type=int, default=-1, help='local rank passed from distributed launcher')
    parser.add_argument('-s', '--steps', type=int, default=100, help='quit after this many steps')
    parser.add_argument('-p', '--pipeline-parallel-size', type=int, default=2, help='pipeline parallelism')
    parser.add_argument('--backend', type=str, default='gloo', help='distributed backend')
    parser.add_argument('--seed', type=int, default=1138, help='PRNG seed')
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    return args


def train_base(args):
    torch.manual_seed(args.seed)

    net = AlexNet(num_classes=10)

    trainset = cifar_trainset(args.local_rank, 256 * args.steps)

    engine, _, dataloader, __ = deepspeed.initialize(
        args=args,
        model=net,
        model_parameters=[p for p in net.parameters() if p.requires_grad],
        training_data=trainset)

    dataloader = RepeatingLoader(dataloader)
    data_iter = iter(dataloader)

    rank = dist.get_rank()

    criterion = torch.nn.CrossEntropyLoss()

    total_steps = args.steps * engine.gradient_accumulation_steps()
    step = 0
    losses = []
    for micro_step in range(total_steps):
        batch = next(data_iter)
        inputs = batch[0].to(engine.device)
        labels = batch[1].to(engine.device)

        outputs = engine(inputs)
        loss = criterion(outputs, labels)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())

        if micro_step % engine.gradient_accumulation_steps() == 0:
            step += 1
            if rank == 0 and (step % 10 == 0):
                print(f'step: {step:3d} / {args.steps:3d} loss: {loss}')
    return engine, losses


def join_layers(vision_model):
    layers = [
        *vision_model.features,
        vision_model.avgpool,
        lambda x: torch.flatten(x, 1),
        *vision_model.classifier,
    ]
    return layers


def train_pipe(args, part='parameters'):
    torch.manual_seed(args.seed)
    deepspeed.runtime.utils.set_random_seed(args.seed)

    #
    # Build the model
    #

    net = AlexNet(num_classes=10)
    net = PipelineModule(layers=join_layers(net),
                         loss_fn=torch.nn.CrossEntropyLoss(),
                         num_stages=args.pipeline_parallel_size,
                         partition_method=part,
                         activation_checkpoint_interval=0)

    trainset = cifar_trainset(args.local_rank, 256 * args.steps)

    engine, _, _, _ = deepspeed.initialize(
        args=args,
        model=net,
        model_parameters=[p for p in net.parameters() if p.requires_grad],
        training_data=trainset)

    losses = []
    for step in range(args.steps):
        loss = engine.train_batch()
        losses.append(loss.item())
    return engine, losses


if __name__ == '__main__':
    args = get_args()

    deepspeed.init_distributed(dist_backend=args.backend)
    args.local_rank = int(os.environ['LOCAL_RANK'])
    get_accelerator().set_device(args.local_rank)

    if args.pipeline_parallel_size == 0:
        engine, losses = train_base(args)
    else:
        engine, losses = train_pipe(args)

    if dist.get_rank() == 0:
        result = json.dumps({"rank0": losses, "lr": engine.get_lr()})
        print("LOSSES " + result, flush=True)
        if os.environ.get("DS_EXAMPLE_LOSSES"):  # the test reads a file: the ranks' stdout lines may interleave
            with open(os.environ["DS_EXAMPLE_LOSSES"], "w") as f:
                f.write(result)
