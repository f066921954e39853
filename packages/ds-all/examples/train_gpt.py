"""The main job: a GPT trained from a DeepSpeed JSON on 2 ranks.

    ds-launch --num_procs 2 examples/train_gpt.py [--config examples/ds_config_gpt.json] [--steps 30]

The GPT of ARCHITECTURE.md, 'The yardstick workload' (pre-LN decoder, vocab 8192, d_model 512, 8 layers, 8 heads, sequence 256:
about 34M parameters), trained by ``ds_all.initialize`` from the JSON next to this file: ZeRO with the
optimizer offloaded to the CPU, WarmupCosineLR, gradient clipping, TensorBoard and CSV logs, a flops
profile at step 2 and the comms logger's summary at the end; rank 0 prints the loss every 10 steps
(the engine's ``steps_per_print``) and shows a progress bar on a terminal. The data is synthetic with a structure
to learn: each sequence walks a fixed random successor table over 512 of the tokens (the next token
is the table's 9 times in 10), so the loss falls from ln(8192) ≈ 9 towards the walk's entropy.

bf16: the JSON enables it, as a GPU user would. A CPU without native bfloat16 (no AVX512-BF16/AMX)
runs bf16 matmuls dozens of times slower than float32; there ``--precision auto`` (the default)
trains in float32 and says so, ``--precision bf16`` insists. ``--tiny`` shrinks the model (tests).
Exit code 1 when the loss did not fall by half.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import ds_all
from ds_all.accelerator import get_accelerator

HERE = Path(__file__).resolve().parent
SHAPES = {"full": {"vocab": 8192, "d_model": 512, "layers": 8, "heads": 8, "seq": 256},
          "tiny": {"vocab": 256, "d_model": 64, "layers": 2, "heads": 2, "seq": 32}}
USED_TOKENS = {"full": 512, "tiny": 16}  # the tokens the walks visit


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.fc, self.out = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(attn)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d_model: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.tok, self.pos = nn.Embedding(vocab, d_model), nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, self.vocab), tokens[:, 1:].reshape(-1).long())


class Walks(torch.utils.data.Dataset):
    """Sequences walking a fixed successor table over ``used`` tokens, with 10 % random steps."""

    def __init__(self, samples: int, seq: int, used: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        successor = torch.randperm(used, generator=g)
        tokens = torch.empty(samples, seq, dtype=torch.int64)
        tokens[:, 0] = torch.randint(0, used, (samples,), generator=g)
        for t in range(1, seq):
            jump = torch.rand(samples, generator=g) < 0.1
            tokens[:, t] = torch.where(jump, torch.randint(0, used, (samples,), generator=g),
                                       successor[tokens[:, t - 1]])
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i]


def bf16_is_emulated() -> float | None:
    """How many times slower a bf16 matmul runs than float32 here, when that is over 8 (emulated). Timed on
    rank 0 and sent to every rank: they must all pick the same precision (a rank in bf16 and one in float32
    would exchange tensors of different sizes), and a timing on a busy machine differs from rank to rank.
    None on an accelerator (the check is the CPU's: a GPU's own bf16 is native)."""
    if get_accelerator().device_name() != "cpu":
        return None
    ds_all.init_distributed()
    slowdown = torch.zeros(1, dtype=torch.float64)
    if ds_all.comm.get_rank() == 0:
        a32, b32 = torch.randn(256, 512), torch.randn(512, 512)
        a16, b16 = a32.bfloat16(), b32.bfloat16()
        seconds = []
        for a, b in ((a32, b32), (a16, b16)):
            a @ b
            best = float("inf")
            for _ in range(3):  # the fastest of three: the least disturbed by other work
                start = time.perf_counter()
                a @ b
                best = min(best, time.perf_counter() - start)
            seconds.append(best)
        slowdown[0] = seconds[1] / seconds[0]
    ds_all.comm.broadcast(slowdown, src=0)
    return float(slowdown) if float(slowdown) > 8 else None


def main() -> int:
    parser = argparse.ArgumentParser(description="Train a GPT with ds_all from a DeepSpeed JSON")
    parser.add_argument("--config", default=str(HERE / "ds_config_gpt.json"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto")
    parser.add_argument("--tiny", action="store_true", help="a small model (tests)")
    parser.add_argument("--local_rank", type=int, default=0)  # passed by ds-launch
    args = parser.parse_args()
    if args.steps < 4:
        parser.error("--steps must be >= 4")
    torch.set_num_threads(1)
    config = json.loads(Path(args.config).read_text())
    if config.get("scheduler", {}).get("params", {}).get("total_num_steps") == "auto":
        config["scheduler"]["params"]["total_num_steps"] = args.steps
    note = None
    if args.precision == "fp32" or (args.precision == "auto" and config.get("bf16", {}).get("enabled")):
        slowdown = bf16_is_emulated() if args.precision == "auto" else None
        if args.precision == "fp32" or slowdown:
            config["bf16"] = {"enabled": False}
            note = (f"bf16 matmuls run {slowdown:.0f}x slower than float32 on this CPU (no native bfloat16): "
                    "training in float32 (--precision bf16 insists)" if slowdown else "float32 (--precision fp32)")
    shape = SHAPES["tiny" if args.tiny else "full"]
    torch.manual_seed(0)
    model = GPT(**shape)
    micro = config["train_micro_batch_size_per_gpu"]
    data = Walks(samples=micro * 2 * args.steps, seq=shape["seq"], used=USED_TOKENS["tiny" if args.tiny else "full"])
    parameters = sum(p.numel() for p in model.parameters())  # counted whole (ZeRO-3 partitions them)
    engine, _, loader, _ = ds_all.initialize(model=model, config=config, training_data=data)
    rank = ds_all.comm.get_rank()
    if rank == 0:
        print(f"GPT {parameters / 1e6:.1f}M parameters, {ds_all.comm.get_world_size()} ranks, ZeRO stage "
              f"{engine.zero_optimization_stage()}, {'bf16' if engine.bf16_enabled() else 'float32'}, "
              f"{args.steps} steps" + (f"\n{note}" if note else ""), flush=True)
    progress = None
    if rank == 0 and sys.stderr.isatty():
        try:
            from tqdm import tqdm
        except ImportError:  # no bar then; the engine still prints every steps_per_print steps
            print("(pip install tqdm for a progress bar)", file=sys.stderr)
        else:
            progress = tqdm(total=args.steps, unit="step", file=sys.stderr)
    losses, batches, start = [], iter(loader), time.perf_counter()
    while engine.global_steps < args.steps:
        loss = engine(next(batches))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if progress is not None:  # the engine prints the loss every steps_per_print steps
            progress.update(1)
            progress.set_postfix(loss=f"{losses[-1]:.3f}")
    if progress is not None:
        progress.close()
    elapsed = time.perf_counter() - start
    ds_all.comm.log_summary()
    logs = engine.monitor.paths()
    engine.destroy()
    fell = losses[-1] < 0.5 * losses[0]
    if rank == 0:
        print(f"loss {'fell' if fell else 'did NOT fall'}: {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps, "
              f"{elapsed:.0f} s ({elapsed / args.steps:.2f} s/step)")
        for kind, path in logs.items():
            print(f"logs ({kind}): {path}")
    return 0 if fell else 1


if __name__ == "__main__":
    sys.exit(main())
