"""3D parallelism as DeepSpeed's Megatron examples run it: a `PipelineModule` whose stages are built from
ds-parallel's column- and row-parallel layers, over ``PipeModelDataParallelTopology`` (pipe × data × model),
ZeRO stage 1 in the engine, which takes the module's mpu. PP2 × TP2 on 4 ranks trains like the unsplit model
in a plain torch loop (each step's loss, every gathered weight), gradient clipping by the whole model's norm
included (a replicated parameter counted once over the tensor-parallel ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_comm.testing import spawn

IN, D, HIDDEN, OUT, ROWS, SEQ, MICRO_BATCHES, STEPS, LR = 8, 16, 32, 4, 2, 4, 2, 3, 1e-2
MORE = 2  # steps after loading the 3D checkpoint at PP1 x TP2 x DP2
CLIP = 0.05  # below the gradients' norm: every step clips, by the norm of the whole model
BASE_SEED = 1234


class ParallelMLP(nn.Module):
    """x + Row(gelu(Column(LayerNorm(x)))): the column layer's output stays split, the row layer's arrives
    whole (all-reduced) on every tensor-parallel rank, so the stage's output is a full tensor."""

    def __init__(self, d: int, hidden: int, group=None):
        super().__init__()
        from ds_parallel import ColumnParallelLinear, RowParallelLinear
        self.ln = nn.LayerNorm(d)
        self.fc = ColumnParallelLinear(d, hidden, gather_output=False, group=group)
        self.proj = RowParallelLinear(hidden, d, input_is_parallel=True, group=group)

    def forward(self, x):
        h, _ = self.fc(self.ln(x))
        out, _ = self.proj(F.gelu(h))
        return x + out


class ParallelHead(nn.Module):
    def __init__(self, d: int, out: int, group=None):
        super().__init__()
        from ds_parallel import ColumnParallelLinear
        self.fc = ColumnParallelLinear(d, out, gather_output=True, group=group)

    def forward(self, x):
        return self.fc(x)[0]


def layer_specs(group=None):
    from ds_pipe import LayerSpec
    return [LayerSpec(nn.Linear, IN, D), LayerSpec(ParallelMLP, D, HIDDEN, group=group),
            LayerSpec(ParallelMLP, D, HIDDEN, group=group), LayerSpec(nn.Tanh),
            LayerSpec(ParallelHead, D, OUT, group=group)]


def micro_batches(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(ROWS, SEQ, IN, generator=g), torch.randn(ROWS, SEQ, OUT, generator=g))
            for _ in range(MICRO_BATCHES)]


# -- the reference: the unsplit model, plain torch ------------------------------------------------------
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc, self.proj = nn.LayerNorm(D), nn.Linear(D, HIDDEN), nn.Linear(HIDDEN, D)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.ln(x))))


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, OUT)

    def forward(self, x):
        return self.fc(x)


def _megatron_init(linear: nn.Linear) -> None:
    """Megatron's initialisation of a whole layer: the weight drawn by xavier_normal_ in float32, the bias 0."""
    with torch.no_grad():
        linear.weight.copy_(nn.init.xavier_normal_(torch.empty_like(linear.weight)))
        linear.bias.zero_()


def reference(steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    layers = []
    for idx, build in enumerate([lambda: nn.Linear(IN, D), MLP, MLP, nn.Tanh, Head]):
        torch.manual_seed(BASE_SEED + idx)  # PipelineModule(seed_layers=True)'s seed for layer idx
        if build in (MLP, Head):
            module = build()
            torch.manual_seed(BASE_SEED + idx)
            for linear in [m for m in module.modules() if isinstance(m, nn.Linear)]:
                _megatron_init(linear)  # in the order the parallel layers draw (fc, then proj)
        else:
            module = build()
        layers.append(module)
    model = nn.Sequential(*layers)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        total = 0.0
        for x, y in micro_batches(step):
            loss = F.mse_loss(model(x), y)
            (loss / MICRO_BATCHES).backward()
            total += loss.item()
        assert torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP) > CLIP
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / MICRO_BATCHES)
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


# -- 3D --------------------------------------------------------------------------------------------------
def train_3d(rank, world, partitioned, directory):
    import ds_all
    import ds_parallel
    from ds_comm import PipeModelDataParallelTopology
    from ds_pipe import PipelineModule

    topology = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)
    mpu = ds_parallel.ModelParallelUnit(topology=topology)  # the layers' tensor-parallel group (Megatron's mpu)
    module = PipelineModule(layer_specs(mpu.get_tensor_model_parallel_group()), topology=topology,
                            loss_fn=F.mse_loss, seed_layers=True, base_seed=BASE_SEED, partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": MICRO_BATCHES,
              "optimizer": {"type": "Adam", "params": {"lr": LR}}, "zero_optimization": {"stage": 1},
              "gradient_clipping": CLIP, "steps_per_print": 1000,
              "pipeline": {"pipe_partitioned": partitioned, "grad_partitioned": partitioned}}
    engine, *_ = ds_all.initialize(model=module, config=config)
    grid = module.mpu()
    assert engine.mpu is grid and grid.get_tensor_model_parallel_world_size() == 2
    assert engine.dp_world_size == 1 and engine.zero_optimization_stage() == 1
    assert engine.executor.pipe_partitioned is partitioned and engine.executor.grad_partitioned is partitioned
    losses = [float(engine.train_batch(iter(micro_batches(step)))) for step in range(STEPS)]
    params = {}
    for idx in module.chunk_layers(0):
        layer = getattr(module, str(idx), None)
        for name, p in layer.named_parameters() if layer is not None else ():
            sliced = getattr(p, "tensor_model_parallel", False)
            params[f"{idx}.{name}"] = (p.detach().clone(), p.partition_dim if sliced else None)
    if directory is not None:
        engine.save_checkpoint(directory, tag="end")
    engine.destroy()
    return {"stage": grid.get_stage_id(), "tp_rank": grid.get_tensor_model_parallel_rank(), "losses": losses,
            "params": params}


def resume_3d(rank, world, directory):
    """The PP2 x TP2 checkpoint loaded at PP1 x TP2 x DP2 (ZeRO-1 now splits each slice between two replicas,
    each replica takes half of every micro-batch), MORE steps on."""
    import ds_all
    import ds_parallel
    from ds_comm import PipeModelDataParallelTopology
    from ds_pipe import PipelineModule

    topology = PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=2)
    mpu = ds_parallel.ModelParallelUnit(topology=topology)
    module = PipelineModule(layer_specs(mpu.get_tensor_model_parallel_group()), topology=topology,
                            loss_fn=F.mse_loss, seed_layers=True, base_seed=BASE_SEED + 1, partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": ROWS // 2, "gradient_accumulation_steps": MICRO_BATCHES,
              "optimizer": {"type": "Adam", "params": {"lr": LR}}, "zero_optimization": {"stage": 1},
              "gradient_clipping": CLIP, "steps_per_print": 1000}
    engine, *_ = ds_all.initialize(model=module, config=config)
    assert engine.dp_world_size == 2
    path, _ = engine.load_checkpoint(directory, tag="end")
    assert path is not None and engine.global_steps == STEPS
    half = module.mpu().get_data_parallel_rank()
    losses = [float(engine.train_batch(iter([(x[half:half + 1], y[half:half + 1]) for x, y in micro_batches(step)])))
              for step in range(STEPS, STEPS + MORE)]
    params = {name: (p.detach().clone(), p.partition_dim if getattr(p, "tensor_model_parallel", False) else None)
              for name, p in module.named_parameters()}
    engine.destroy()
    return {"tp_rank": module.mpu().get_tensor_model_parallel_rank(), "dp_rank": half, "losses": losses,
            "params": params}


def train_both(rank, world, directory):
    return [train_3d(rank, world, True, directory), train_3d(rank, world, False, None), resume_3d(rank, world, directory)]


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt_3d")


@pytest.fixture(scope="module")
def runs(checkpoint_dir):
    return spawn(train_both, world_size=4, args=(str(checkpoint_dir),), timeout=300)


@pytest.mark.parametrize("partitioned", [True, False], ids=["p2p-split-over-tp", "p2p-whole"])
def test_pp2_tp2_trains_like_the_unsplit_model(partitioned, runs):
    """With pipeline.pipe_partitioned/grad_partitioned (DeepSpeed's default) each tensor-parallel rank sends
    its part of the activations and gradients between stages; without, the whole tensors: the same training."""
    want_losses, want = reference()
    results = [r[0 if partitioned else 1] for r in runs]
    assert sorted((r["stage"], r["tp_rank"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in results:
        assert r["losses"] == pytest.approx(want_losses, rel=1e-6, abs=1e-6), r["stage"]
    gathered: dict[str, list] = {}
    for r in sorted(results, key=lambda r: r["tp_rank"]):
        for name, (tensor, dim) in r["params"].items():
            gathered.setdefault(name, []).append((tensor, dim))
    assert set(gathered) == set(want)
    for name, pieces in gathered.items():
        dim = pieces[0][1]
        whole = torch.cat([t for t, _ in pieces], dim=dim) if dim is not None else pieces[0][0]
        if dim is None:  # replicated over the tensor-parallel ranks: the same on both
            torch.testing.assert_close(pieces[1][0], pieces[0][0], rtol=0, atol=0)
        torch.testing.assert_close(whole, want[name], rtol=1e-6, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_a_3d_checkpoint_holds_the_whole_weights(runs, checkpoint_dir):
    """Every stage's tensor slices saved as their parts of the whole parameters: ds-zero's fp32 export of the
    PP2 × TP2 checkpoint is the unsplit model's state dict (DeepSpeed's zero_to_fp32, without the model)."""
    from ds_zero import get_fp32_state_dict_from_zero_checkpoint
    _, want = reference()
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir)
    assert set(state) == set(want)
    for name, tensor in state.items():
        torch.testing.assert_close(tensor, want[name], rtol=1e-6, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_a_3d_checkpoint_loads_at_another_layout_and_trains_on(runs):
    """PP2 x TP2 (DP1) saved, PP1 x TP2 x DP2 loaded (the pipeline's layers named by their index, each slice
    read from the whole and split by ZeRO-1 between the replicas): MORE steps equal the uninterrupted
    unsplit run's."""
    want_losses, want = reference(STEPS + MORE)
    results = [r[2] for r in runs]
    for r in results:
        assert r["losses"] == pytest.approx(want_losses[STEPS:], rel=1e-6, abs=1e-6)
    by_tp = {(r["tp_rank"], r["dp_rank"]): r["params"] for r in results}
    assert set(by_tp) == {(0, 0), (0, 1), (1, 0), (1, 1)}
    for name, (tensor, dim) in by_tp[(0, 0)].items():
        for tp_rank in (0, 1):  # the replicas agree
            torch.testing.assert_close(by_tp[(tp_rank, 1)][name][0], by_tp[(tp_rank, 0)][name][0], rtol=0, atol=0)
        whole = torch.cat([tensor, by_tp[(1, 0)][name][0]], dim=dim) if dim is not None else tensor
        torch.testing.assert_close(whole, want[name], rtol=1e-6, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
