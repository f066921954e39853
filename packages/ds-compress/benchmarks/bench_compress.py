"""Model size on disk, forward latency and accuracy of a small transformer encoder, before and after
``redundancy_clean``, for (a) 50% row pruning of the FFN, (b) 50% head pruning, (c) 4-bit weights
(``pack=True``); then the bytes of the state_dict of every Linear and Embedding weight quantized at
8, 4, 2 and 1 bits, cleaned with float weights (the default) and with ``pack=True``.

The baseline is what a user has without ds-compress: the trained, uncompressed model.  Each variant
starts from that model, is compressed with ``init_compression``, fine-tuned a few steps with the
scheduler, then cleaned.  Run: ``python benchmarks/bench_compress.py [--json PATH]``.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from ds_compress import CompressionScheduler, init_compression, redundancy_clean

VOCAB, CLASSES = 64, 4


class SelfAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.head_dim = dim // heads
        self.query, self.key, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, t, _ = x.shape
        heads = self.query.out_features // self.head_dim  # follows head pruning

        def split(y):
            return y.view(b, t, heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(split(self.query(x)), split(self.key(x)), split(self.value(x)))
        return out.transpose(1, 2).reshape(b, t, heads * self.head_dim)


class Block(nn.Module):
    def __init__(self, dim, heads, ffn):
        super().__init__()
        self.attention = nn.ModuleDict({"self": SelfAttention(dim, heads), "output": nn.Linear(dim, dim)})
        self.intermediate, self.output = nn.Linear(dim, ffn), nn.Linear(ffn, dim)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)

    def forward(self, x):
        x = self.norm1(x + self.attention["output"](self.attention["self"](x)))
        return self.norm2(x + self.output(F.gelu(self.intermediate(x))))


# Not the yardstick GPT (ARCHITECTURE.md): a post-LN encoder classifier whose modules carry BERT's names
# (attention.self.query, intermediate, output), the names that compression configs match, as DeepSpeed's examples.
class Encoder(nn.Module):
    def __init__(self, dim=128, heads=8, ffn=512, layers=4):
        super().__init__()
        self.embeddings = nn.Embedding(VOCAB, dim)
        self.layer = nn.ModuleList([Block(dim, heads, ffn) for _ in range(layers)])
        self.classifier = nn.Linear(dim, CLASSES)

    def forward(self, ids):
        x = self.embeddings(ids)
        for block in self.layer:
            x = block(x)
        return self.classifier(x.mean(dim=1))


def task(n, seq, generator):
    """Label: the most frequent class (token id % 4) in the sequence: learnable, needs every token."""
    ids = torch.randint(0, VOCAB, (n, seq), generator=generator)
    counts = F.one_hot(ids % CLASSES, CLASSES).sum(dim=1).float() + torch.rand(n, CLASSES, generator=generator) * 0.1
    return ids, counts.argmax(dim=1)


def train(model, data, steps, batch=64, lr=1e-3, scheduler=None):
    ids, labels = data
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for step in range(steps):
        idx = torch.arange(step * batch, (step + 1) * batch) % len(ids)
        loss = F.cross_entropy(model(ids[idx]), labels[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
    return model.eval()


@torch.no_grad()
def accuracy(model, data):
    return model(data[0]).argmax(dim=1).eq(data[1]).float().mean().item()


def disk_bytes(model):
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.tell()


@torch.no_grad()
def latency_ms(model, ids, repeats):
    model(ids)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(ids)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def weight_quantization(bits):
    return {"weight_quantization": {
        "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True, "quantize_groups": 8},
        "different_groups": {"wq": {"params": {"start_bits": bits, "target_bits": bits},
                                    "modules": ["layer", "embeddings", "classifier"]}}}}


def storage_sizes(base, probe):
    """Bytes of ``torch.save(state_dict)`` of the cleaned encoder, float weights vs packed codes;
    the packed model must compute what the float-cleaned one does."""
    rows = [{"storage": "float32, no compression", "bits": None, "bytes": disk_bytes(base)}]
    for bits in (8, 4, 2, 1):
        cfg = weight_quantization(bits)
        float_model = redundancy_clean(init_compression(copy.deepcopy(base), cfg), cfg).eval()
        packed = redundancy_clean(init_compression(copy.deepcopy(base), cfg), cfg, pack=True).eval()
        with torch.no_grad():
            if not torch.allclose(float_model(probe), packed(probe), atol=1e-5):
                raise RuntimeError(f"{bits} bits: the packed model does not compute what the float one does")
        rows.append({"storage": f"{bits}-bit, default (float weights)", "bits": bits, "bytes": disk_bytes(float_model)})
        rows.append({"storage": f"{bits}-bit, pack=True", "bits": bits, "bytes": disk_bytes(packed)})
    return rows


VARIANTS = {
    "row pruning 50% (FFN)": {"row_pruning": {
        "shared_parameters": {"enabled": True, "method": "l1"},
        "different_groups": {"rp": {"params": {"dense_ratio": 0.5}, "modules": ["intermediate"],
                                    "related_modules": [["layer\\.\\d+\\.output"]]}}}},
    "head pruning 50%": {"head_pruning": {
        "shared_parameters": {"enabled": True, "method": "topk", "num_heads": 8},
        "different_groups": {"hp": {"params": {"dense_ratio": 0.5}, "modules": ["attention.output"],
                                    "related_modules": [["self.query", "self.key", "self.value"]]}}}},
    "4-bit weights (pack)": {"weight_quantization": {
        "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True, "quantize_groups": 8},
        "different_groups": {"wq": {"params": {"start_bits": 4, "target_bits": 4},
                                    "modules": ["layer", "embeddings"]}}}},
}
PACK = {"4-bit weights (pack)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--finetune-steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data, test = task(8192, 32, g), task(2048, 32, g)
    base = train(Encoder(), data, args.train_steps)
    probe = test[0][:64]
    base_bytes, base_ms, base_acc = disk_bytes(base), latency_ms(base, probe, args.repeats), accuracy(base, test)
    rows = []
    for name, cfg in VARIANTS.items():
        model = init_compression(copy.deepcopy(base), cfg)
        train(model, data, args.finetune_steps, lr=3e-4, scheduler=CompressionScheduler(model, cfg))
        acc_before = accuracy(model, test)
        redundancy_clean(model, cfg, pack=name in PACK)
        acc_after = accuracy(model, test)
        rows.append({"variant": name, "bytes_baseline": base_bytes, "bytes_ours": disk_bytes(model),
                     "latency_ms_baseline": base_ms, "latency_ms_ours": latency_ms(model, probe, args.repeats),
                     "accuracy_baseline": base_acc, "accuracy_compressed": acc_before, "accuracy_cleaned": acc_after})
    header = (f"{'variant':<24}{'bytes base':>12}{'bytes ours':>12}{'ratio':>7}{'fwd ms base':>13}"
              f"{'fwd ms ours':>13}{'ratio':>7}{'acc base':>10}{'acc ours':>10}{'after clean':>13}")
    print(f"encoder: 4 layers, dim 128, 8 heads, FFN 512; forward on 64 x 32 tokens, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads")
    print(header)
    for r in rows:
        print(f"{r['variant']:<24}{r['bytes_baseline']:>12,}{r['bytes_ours']:>12,}"
              f"{r['bytes_ours'] / r['bytes_baseline']:>7.2f}{r['latency_ms_baseline']:>13.2f}"
              f"{r['latency_ms_ours']:>13.2f}{r['latency_ms_ours'] / r['latency_ms_baseline']:>7.2f}"
              f"{r['accuracy_baseline']:>10.4f}{r['accuracy_compressed']:>10.4f}{r['accuracy_cleaned']:>13.4f}")
        if not math.isclose(r["accuracy_compressed"], r["accuracy_cleaned"], abs_tol=1e-3):
            print(f"  note: {r['variant']}: cleaning changed the accuracy")
    sizes = storage_sizes(base, probe)
    print("\nstate_dict bytes, every Linear and Embedding weight quantized (quantize_groups 8):")
    print(f"{'storage':<34}{'bytes':>12}{'ratio':>7}")
    for r in sizes:
        print(f"{r['storage']:<34}{r['bytes']:>12,}{r['bytes'] / sizes[0]['bytes']:>7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "bench_compress", "rows": rows, "storage": sizes}, f, indent=2)


if __name__ == "__main__":
    main()
