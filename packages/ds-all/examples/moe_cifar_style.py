"""DeepSpeed's Mixture-of-Experts tutorial (https://www.deepspeed.ai/tutorials/mixture-of-experts/): the
CIFAR-10 example of DeepSpeedExamples (training/cifar/cifar10_deepspeed.py) with ``import deepspeed``
changed to ``import ds_all as deepspeed``. Its small CNN's last hidden layer is ``deepspeed.moe.layer.MoE``
(one layer per entry of ``--num-experts``; ``--mlp-type residual`` is PR-MoE), its parameters are split into
MoE groups for ZeRO with ``split_params_into_different_moe_groups_for_optimizer`` (``--moe-param-group``),
and ``deepspeed.initialize(args=args, model=net, model_parameters=parameters, training_data=trainset)``
builds the engine from ``--deepspeed_config``.

    ds-launch --num_gpus 2 examples/moe_cifar_style.py --deepspeed --deepspeed_config ds_config.json \\
        --moe --ep-world-size 2 --num-experts 2 --top-k 1 --noisy-gate-policy RSample --moe-param-group

What differs from the original: no download (the images are random tensors of CIFAR-10's shape, each
class with a pattern of its own added, so that there is something to learn), no matplotlib, the data's
size is ``--samples``, and without ``--deepspeed_config`` the example's own ds_config.json is used (in
float32). Rank 0 prints the running loss every ``--log-interval`` steps and the test accuracy at the end,
as the original does.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import ds_all as deepspeed
from ds_all.accelerator import get_accelerator


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("-b", "--batch_size", default=32, type=int, help="mini-batch size (default: 32)")
    parser.add_argument("-e", "--epochs", default=2, type=int, help="number of total epochs (default: 2)")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--log-interval", type=int, default=2000,
                        help="output logging information at a given interval")
    parser.add_argument("--samples", type=int, default=2048, help="training images made (the original: 50000)")
    parser.add_argument("--moe", default=False, action="store_true", help="use deepspeed mixture of experts (moe)")
    parser.add_argument("--ep-world-size", default=1, type=int, help="(moe) expert parallel world size")
    parser.add_argument("--num-experts", type=int, nargs="+", default=[1], help="number of experts list, MoE related.")
    parser.add_argument("--mlp-type", type=str, default="standard",
                        help="Only applicable when num-experts > 1, accepts [standard, residual]")
    parser.add_argument("--top-k", default=1, type=int, help="(moe) gating top 1 and 2 supported")
    parser.add_argument("--min-capacity", default=0, type=int,
                        help="(moe) minimum capacity of an expert regardless of the capacity_factor")
    parser.add_argument("--noisy-gate-policy", default=None, type=str,
                        help="(moe) noisy gating (only supported with top-1). Valid values are None, RSample, and "
                             "Jitter")
    parser.add_argument("--moe-param-group", default=False, action="store_true",
                        help="(moe) create separate moe param groups, required when using ZeRO w. MoE")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def example_config():
    """DeepSpeedExamples' training/cifar/ds_config.json, in float32 (it turns fp16 on)."""
    return {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                  "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                      "warmup_num_steps": 1000}},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": 0, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000,
                              "overlap_comm": True, "contiguous_gradients": True},
    }


def cifar_shaped(samples, seed):
    """``samples`` 3x32x32 images in [-1, 1]-ish with labels 0-9: noise plus the label's own pattern."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(10, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 10, (samples,), generator=g)
    images = 0.5 * torch.randn(samples, 3, 32, 32, generator=g) + patterns[labels]
    return torch.utils.data.TensorDataset(images, labels)


class Net(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.moe = args.moe
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        if args.moe:
            fc3 = nn.Linear(84, 84)
            self.moe_layer_list = []
            for n_e in args.num_experts:
                # create moe layers based on the number of experts
                self.moe_layer_list.append(
                    deepspeed.moe.layer.MoE(
                        hidden_size=84,
                        expert=fc3,
                        num_experts=n_e,
                        ep_size=args.ep_world_size,
                        use_residual=args.mlp_type == "residual",
                        k=args.top_k,
                        min_capacity=args.min_capacity,
                        noisy_gate_policy=args.noisy_gate_policy))
            self.moe_layer_list = nn.ModuleList(self.moe_layer_list)
            self.fc4 = nn.Linear(84, 10)
        else:
            self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        if self.moe:
            for layer in self.moe_layer_list:
                x, _, _ = layer(x)
            x = self.fc4(x)
        else:
            x = self.fc3(x)
        return x


def create_moe_param_groups(model):
    from ds_all.moe.utils import split_params_into_different_moe_groups_for_optimizer

    parameters = {"params": [p for p in model.parameters()], "name": "parameters"}
    return split_params_into_different_moe_groups_for_optimizer(parameters)


def main(args):
    deepspeed.init_distributed()
    trainset = cifar_shaped(args.samples, seed=1)
    testset = cifar_shaped(max(args.samples // 8, 4), seed=2)
    testloader = torch.utils.data.DataLoader(testset, batch_size=4, shuffle=False)

    torch.manual_seed(0)  # every rank the same dense weights
    net = Net(args)
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    if args.moe_param_group:
        parameters = create_moe_param_groups(net)

    # Initialize DeepSpeed to use the following features
    # 1) Distributed model
    # 2) Distributed data loader
    # 3) DeepSpeed optimizer
    config = None if getattr(args, "deepspeed_config", None) else example_config()
    model_engine, _optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset, config=config)

    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank
    bf16 = model_engine.bfloat16_enabled()
    fp16 = model_engine.fp16_enabled()
    print(f"bf16={bf16}")

    criterion = nn.CrossEntropyLoss()
    for epoch in range(args.epochs):  # loop over the dataset multiple times
        running_loss = 0.0
        for i, data in enumerate(trainloader):
            # get the inputs; data is a list of [inputs, labels]
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if bf16:
                inputs = inputs.to(torch.bfloat16)
            elif fp16:
                inputs = inputs.half()
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)

            model_engine.backward(loss)
            model_engine.step()

            # print statistics
            running_loss += loss.item()
            if local_rank == 0 and i % args.log_interval == (args.log_interval - 1):
                print(f"[{epoch + 1}, {i + 1:5d}] loss: {running_loss / args.log_interval:.3f}", flush=True)
                running_loss = 0.0
    print("Finished Training", flush=True)

    # every rank runs the same test batches: with expert parallelism each forward is a collective
    correct = total = 0
    with torch.no_grad():
        for images, labels in testloader:
            if bf16:
                images = images.to(torch.bfloat16)
            elif fp16:
                images = images.half()
            outputs = model_engine(images.to(local_device))
            _, predicted = torch.max(outputs.data, 1)
            total += labels.size(0)
            correct += (predicted == labels.to(local_device)).sum().item()
    if local_rank == 0:
        print(f"Accuracy of the network on the {total} test images: {100 * correct // total} %", flush=True)


if __name__ == "__main__":
    main(add_argument())
