"""DeepSpeedExamples' training/cifar/cifar10_deepspeed.py, adapted only for a CPU without internet: the
CIFAR-10 images are random tensors of their shape (torchvision has no CPU build here), a few steps, the
example's ``--moe`` options left out (its MoE path, over ``ds_all.moe``, runs in
``examples/moe_cifar_style.py``, tested by ``test_moe_tutorial.py``), and the losses printed as JSON. The
import is the one line a user changes: ``DS_EXAMPLE_BACKEND=deepspeed`` runs it on DeepSpeed itself
(how the losses in ``cifar10_losses.json`` were made), anything else on ds.

    ds-launch --num_procs 2 cifar10_deepspeed.py --stage 2 --dtype fp32
"""

import argparse
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

if os.environ.get("DS_EXAMPLE_BACKEND") == "deepspeed":
    import deepspeed
    from deepspeed.accelerator import get_accelerator
else:
    import ds_all as deepspeed
    from ds_all.accelerator import get_accelerator


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("-e", "--epochs", default=1, type=int)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--log-interval", type=int, default=2000)
    parser.add_argument("--dtype", default="fp16", type=str, choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--stage", default=0, type=int, choices=[0, 1, 2, 3])
    parser.add_argument("--steps", default=6, type=int)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def get_ds_config(args):
    """The example's config, unchanged."""
    return {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                  "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                      "warmup_num_steps": 1000}},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {"enabled": args.dtype == "fp16", "fp16_master_weights_and_grads": False, "loss_scale": 0,
                 "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": args.stage, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000,
                              "overlap_comm": True, "contiguous_gradients": True, "cpu_offload": False},
    }


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def main(args):
    deepspeed.init_distributed()
    _local_rank = int(os.environ.get("LOCAL_RANK"))
    get_accelerator().set_device(_local_rank)
    g = torch.Generator().manual_seed(1234)  # CIFAR-10's shapes: 3x32x32 images, 10 classes
    images = torch.randn(16 * args.steps, 3, 32, 32, generator=g)
    trainset = torch.utils.data.TensorDataset(images, torch.randint(0, 10, (16 * args.steps,), generator=g))
    torch.manual_seed(0)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, _optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset, config=get_ds_config(args))
    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half
    criterion = nn.CrossEntropyLoss()
    losses = []
    for _epoch in range(args.epochs):
        for data in trainloader:
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
    if local_rank == 0:
        result = json.dumps({"rank0": losses, "lr": model_engine.get_lr()})
        print("LOSSES " + result, flush=True)
        if os.environ.get("DS_EXAMPLE_LOSSES"):  # the test reads a file: the ranks' stdout lines may interleave
            with open(os.environ["DS_EXAMPLE_LOSSES"], "w") as f:
                f.write(result)
    print("Finished Training")


if __name__ == "__main__":
    main(add_argument())
