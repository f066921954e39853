"""3D parallelism as DeepSpeed's Megatron examples run it: pipeline stages built from tensor-parallel layers,
ZeRO stage 1 over the data-parallel replicas. A DeepSpeed + Megatron script with its imports changed:

    import deepspeed                                                 ->  import ds_all as deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule             ->  from ds_all.pipe import ...
    from deepspeed.runtime.pipe.topology import PipeModelData...     ->  from ds_all.runtime.pipe.topology import ...
    from megatron.core import mpu, tensor_parallel (the layers)      ->  from ds_parallel import ...

    ds-launch --num_procs 4 examples/train_3d.py --pp 2 --tp 2 [--steps 40]     (8 ranks: --pp 2 --tp 2 is DP 2)

Megatron's mpu (here ds-parallel's `ModelParallelUnit`) gives the layers their tensor-parallel group; the
`PipelineModule` takes the same ranks as a ``pipe × data × model`` topology, and the engine takes the module's
mpu (``model.mpu()``): ZeRO partitions over the data-parallel ranks, the gradient norm counts every stage and
every slice (a replicated parameter once). The model is a small GPT: a vocabulary-parallel embedding,
blocks whose attention and MLP are column- then row-parallel, a vocabulary-parallel head and cross entropy
(no rank holds the whole logits). The data is learnable: each sequence counts up from a random token.
Rank 0 prints the loss every 10 steps; exit code 1 if it did not fall by half.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch import nn

import ds_all as deepspeed
from ds_all.pipe import LayerSpec, PipelineModule
from ds_all.runtime.pipe.topology import PipeModelDataParallelTopology
from ds_parallel import (
    ColumnParallelLinear,
    ModelParallelUnit,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)

VOCAB, D_MODEL, HEADS, SEQ, LAYERS = 64, 64, 4, 16, 4


class EmbeddingPipe(nn.Module):
    def __init__(self, group):
        super().__init__()
        self.tokens = VocabParallelEmbedding(VOCAB, D_MODEL, group=group)
        self.positions = nn.Embedding(SEQ, D_MODEL)  # replicated on every tensor-parallel rank
        nn.init.normal_(self.positions.weight, std=0.02)

    def forward(self, ids):
        return self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))


class ParallelBlock(nn.Module):
    """A pre-LN transformer block: q/k/v and the MLP's first linear column-parallel (each rank its heads and
    its hidden units), the projections row-parallel (their outputs all-reduced: every rank holds the whole
    hidden state, which is what the next stage receives)."""

    def __init__(self, group):
        super().__init__()
        tp = torch.distributed.get_world_size(group)
        self.heads = HEADS // tp
        self.ln1, self.ln2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.qkv = ColumnParallelLinear(D_MODEL, 3 * D_MODEL, gather_output=False, group=group)
        self.proj = RowParallelLinear(D_MODEL, D_MODEL, input_is_parallel=True, group=group)
        self.fc = ColumnParallelLinear(D_MODEL, 4 * D_MODEL, gather_output=False, group=group)
        self.out = RowParallelLinear(4 * D_MODEL, D_MODEL, input_is_parallel=True, group=group)

    def forward(self, x):
        b, s, _ = x.shape
        qkv, _ = self.qkv(self.ln1(x))
        q, k, v = qkv.view(b, s, self.heads, 3, D_MODEL // HEADS).permute(3, 0, 2, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.proj(attn)[0]
        h, _ = self.fc(self.ln2(x))
        return x + self.out(F.gelu(h))[0]


class HeadPipe(nn.Module):
    def __init__(self, group):
        super().__init__()
        self.ln = nn.LayerNorm(D_MODEL)
        self.logits = ColumnParallelLinear(D_MODEL, VOCAB, bias=False, gather_output=False, group=group)

    def forward(self, x):
        return self.logits(self.ln(x))[0]  # this rank's part of the vocabulary


def micro_batches(step: int, count: int, rows: int, replica: int):
    g = torch.Generator().manual_seed(1000 * step + replica)
    for _ in range(count):
        tokens = (torch.randint(0, VOCAB, (rows, 1), generator=g) + torch.arange(SEQ)) % VOCAB
        yield tokens, tokens


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--local_rank", type=int, default=0)  # passed by ds-launch
    args = parser.parse_args()
    deepspeed.init_distributed()
    mpu = ModelParallelUnit(tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp)  # Megatron's mpu
    group = mpu.get_tensor_model_parallel_group()
    topology = PipeModelDataParallelTopology(num_pp=mpu.get_pipeline_model_parallel_world_size(),
                                             num_mp=mpu.get_tensor_model_parallel_world_size(),
                                             num_dp=mpu.get_data_parallel_world_size())

    def loss_fn(logits, labels):
        return vocab_parallel_cross_entropy(logits[:, :-1], labels[:, 1:], group=group).mean()

    layers = [LayerSpec(EmbeddingPipe, group), *[LayerSpec(ParallelBlock, group) for _ in range(LAYERS)],
              LayerSpec(HeadPipe, group)]
    model = PipelineModule(layers, topology=topology, loss_fn=loss_fn, partition_method="type:ParallelBlock",
                           seed_layers=True)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4, "steps_per_print": 10,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 1},
              "gradient_clipping": 1.0}
    engine, *_ = deepspeed.initialize(model=model, config=config)  # the engine takes model.mpu()
    replica = engine.get_data_parallel_rank()
    losses = []
    for step in range(args.steps):
        losses.append(float(engine.train_batch(micro_batches(step, 4, 4, replica))))
        if engine.global_rank == 0 and (step + 1) % 10 == 0:
            print(f"step {step + 1}: loss {losses[-1]:.4f} (pipe {args.pp} x tensor {args.tp} x data "
                  f"{engine.dp_world_size})", flush=True)
    engine.destroy()
    return 0 if losses[-1] < losses[0] / 2 else 1


if __name__ == "__main__":
    sys.exit(main())
