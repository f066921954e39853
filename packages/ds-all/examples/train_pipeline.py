"""A pipeline of 2 stages through the engine: a small GPT-style model as a list of layers, trained with
`ds_all.initialize` (ZeRO stage 1 over each stage's replicas, the zero-bubble schedule).

    ds-launch --num_procs 2 examples/train_pipeline.py [--steps 30] [--schedule 1f1b|interleaved|zero_bubble]

Each rank builds only its stage's layers (`LayerSpec`); the token embedding and the LM head share one
weight (`TiedLayerSpec`), its gradient summed over the two stages. The data is learnable: every sequence
counts up from a random token, so the next token is the current one plus one. Rank 0 (the first stage)
and the last stage both read the same micro-batches: the first uses the tokens, the last the labels.
Every rank prints the schedule's table once and the loss every 10 steps (the same on both stages);
exit code 1 if the loss did not fall by half.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch import nn

import ds_all
from ds_all.pipe import LayerSpec, PipelineModule, TiedLayerSpec, TrainSchedule, print_schedule

VOCAB, D_MODEL, HEADS, SEQ, LAYERS = 64, 64, 4, 16, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.qkv, self.proj = nn.Linear(D_MODEL, 3 * D_MODEL), nn.Linear(D_MODEL, D_MODEL)
        self.fc, self.out = nn.Linear(D_MODEL, 4 * D_MODEL), nn.Linear(4 * D_MODEL, D_MODEL)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, HEADS, D_MODEL // HEADS).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, D_MODEL)
        x = x + self.proj(attn)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def head(embedding: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (D_MODEL,)) @ embedding.weight.t()


def loss_fn(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def micro_batches(step: int, count: int, rows: int):
    g = torch.Generator().manual_seed(step)
    for _ in range(count):
        tokens = (torch.randint(0, VOCAB, (rows, 1), generator=g) + torch.arange(SEQ)) % VOCAB
        yield tokens, tokens


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--schedule", default="zero_bubble", choices=["1f1b", "interleaved", "zero_bubble"])
    parser.add_argument("--local_rank", type=int, default=0)  # passed by ds-launch
    args = parser.parse_args()
    ds_all.init_distributed()
    layers = ([TiedLayerSpec("embed", nn.Embedding, VOCAB, D_MODEL)] + [LayerSpec(Block) for _ in range(LAYERS)]
              + [TiedLayerSpec("embed", nn.Embedding, VOCAB, D_MODEL, forward_fn=head)])
    virtual = 2 if args.schedule == "interleaved" else 1
    model = PipelineModule(layers, num_stages=2, loss_fn=loss_fn, partition_method="type:Block", seed_layers=True,
                           virtual_stages=virtual)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4, "steps_per_print": 10,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "zero_optimization": {"stage": 1},
              "pipeline": {"schedule": args.schedule}, "gradient_clipping": 1.0}
    engine, *_ = ds_all.initialize(model=model, config=config)
    if engine.stage_id == 0:
        print(f"stage boundaries {model.parts}; the 1F1B table for comparison:\n"
              + print_schedule(TrainSchedule, stages=2, micro_batches=4), flush=True)
    losses = []
    for step in range(args.steps):
        losses.append(float(engine.train_batch(micro_batches(step, 4, 4))))
        if (step + 1) % 10 == 0:
            print(f"stage {engine.stage_id} step {step + 1} loss {losses[-1]:.4f}", flush=True)
    fell = losses[-1] < 0.5 * losses[0]
    print(f"stage {engine.stage_id}: loss {'fell' if fell else 'did not fall'}: {losses[0]:.3f} -> {losses[-1]:.3f}",
          flush=True)
    engine.destroy()
    return 0 if fell else 1


if __name__ == "__main__":
    sys.exit(main())
