"""The executor against the same model trained unsplit, on 2 and 4 ranks; tied weights; bad input.

Every case of one world size runs inside one spawn (a process start costs more than a tiny case).
The reference is computed on every rank from the same data: the unsplit model, built layer by layer
with the same seeds, accumulating each micro-batch's loss / (micro-batches x replicas).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_comm.testing import spawn

D, VOCAB, SEQ, MB, STEPS = 16, 24, 5, 3, 3


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class TwoOut(nn.Module):
    """Returns a tuple whose second tensor needs no gradient (a mask travelling along)."""

    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        x = x[0] if isinstance(x, tuple) else x
        return self.fc(x), (x > 0).float()


class TwoIn(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, inputs):
        x, mask = inputs
        return self.fc(x) * (1 + mask)


def head(embedding: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    return x @ embedding.weight.t()


def token_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def layers(kind: str):
    from ds_pipe import LayerSpec, TiedLayerSpec
    if kind == "tied":
        return ([TiedLayerSpec("embed", nn.Embedding, VOCAB, D)] + [LayerSpec(Block, D) for _ in range(6)]
                + [TiedLayerSpec("embed", nn.Embedding, VOCAB, D, forward_fn=head)])
    if kind == "tuple":
        # uniform over 2 stages: [0, 3, 5], so the tuple crosses the boundary
        return [LayerSpec(nn.Embedding, VOCAB, D), LayerSpec(Block, D), LayerSpec(TwoOut, D), LayerSpec(TwoIn, D),
                LayerSpec(nn.Linear, D, VOCAB)]
    return ([LayerSpec(nn.Embedding, VOCAB, D)] + [LayerSpec(Block, D) for _ in range(8)]
            + [LayerSpec(nn.Linear, D, VOCAB)])


def reference_model(kind: str) -> list:
    """The unsplit model: the same layers, each built after the seed PipelineModule gives it."""
    from ds_pipe import TiedLayerSpec
    built, tied = [], {}
    for i, spec in enumerate(layers(kind)):
        torch.manual_seed(1234 + i)
        if isinstance(spec, TiedLayerSpec):
            module = tied.setdefault(spec.key, spec.build())
            built.append((module, spec.forward_fn))
        else:
            built.append((spec.build(), None))
    return built


def batches(step: int, replica: int, micro_batches: int, rows: int = MB):
    g = torch.Generator().manual_seed(1000 * step + 100 * replica)
    return [(torch.randint(0, VOCAB, (rows, SEQ), generator=g), torch.randint(0, VOCAB, (rows, SEQ), generator=g))
            for _ in range(micro_batches)]


def reference_run(kind: str, micro_batches: int, replicas: int, lr: float = 0.1):
    built = reference_model(kind)
    params = list({id(p): p for m, _ in built for p in m.parameters()}.values())
    opt = torch.optim.SGD(params, lr=lr)
    losses, states = [], []
    for step in range(STEPS):
        total = 0.0
        for replica in range(replicas):
            for x, y in batches(step, replica, micro_batches):
                for module, forward_fn in built:
                    x = forward_fn(module, x) if forward_fn else module(x)
                loss = token_loss(x, y)
                (loss / (micro_batches * replicas)).backward()
                total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total / (micro_batches * replicas))
        states.append([[p.detach().clone() for p in m.parameters()] for m, _ in built])
    return losses, states


def pipeline_run(kind: str, stages: int, micro_batches: int, schedule: str, virtual: int = 1,
                 checkpoint_interval: int = 0, lr: float = 0.1):
    """Train on this rank's stage; return the losses and, per layer this rank holds, its parameters
    after every step (as lists, which travel back from a spawned rank)."""
    import ds_comm
    from ds_pipe import PipelineExecutor, PipelineModule
    module = PipelineModule(layers(kind), num_stages=stages, loss_fn=token_loss, seed_layers=True,
                            partition_method="uniform", virtual_stages=virtual,
                            activation_checkpoint_interval=checkpoint_interval)
    executor = PipelineExecutor(module, torch.optim.SGD(module.parameters(), lr=lr), micro_batches=micro_batches,
                                schedule=schedule)
    replica = module.mpu().get_data_parallel_rank()
    losses, states = [], []
    for step in range(STEPS):
        losses.append(executor.train_batch(iter(batches(step, replica, micro_batches))).item())
        held = {}
        for chunk in range(virtual):
            for idx, (_, func) in zip(module.chunk_layers(chunk), module._chunks[chunk], strict=False):
                owner = func if isinstance(func, nn.Module) else module.tied_modules["embed"]
                held[idx] = [p.detach().tolist() for p in owner.parameters()]
        states.append(held)
    ds_comm.barrier()
    return losses, states


CASES_2 = [("plain", 2, 4, "1f1b", 1, 0), ("plain", 2, 4, "interleaved", 2, 0), ("plain", 2, 4, "zero_bubble", 1, 0),
           ("tied", 2, 4, "1f1b", 1, 0), ("tied", 2, 4, "zero_bubble", 1, 0), ("tuple", 2, 2, "1f1b", 1, 0),
           ("plain", 2, 4, "1f1b", 1, 2), ("plain", 1, 2, "1f1b", 1, 0)]
CASES_4 = [("plain", 4, 4, "1f1b", 1, 0), ("plain", 4, 8, "interleaved", 2, 0), ("plain", 4, 8, "zero_bubble", 1, 0),
           ("tied", 4, 4, "1f1b", 1, 0), ("plain", 2, 4, "1f1b", 1, 0), ("plain", 2, 4, "zero_bubble", 1, 0)]


def run_cases(rank, world, cases):
    return [pipeline_run(*case) for case in cases]


@pytest.mark.parametrize("world,cases", [(2, CASES_2), (4, CASES_4)], ids=["2 ranks", "4 ranks"])
def test_a_split_model_trains_like_the_unsplit_model(world, cases):
    results = spawn(run_cases, world_size=world, args=(cases,), timeout=240)
    for c, (kind, stages, micro_batches, schedule, virtual, interval) in enumerate(cases):
        name = f"{kind} {stages} stages x {world // stages} replicas, {schedule} v={virtual} ckpt={interval}"
        ref_losses, ref_states = reference_run(kind, micro_batches, world // stages)
        for rank in range(world):
            losses, states = results[rank][c]
            assert losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-6), (name, rank)
            for step, held in enumerate(states):
                assert held, (name, rank)
                for idx, params in held.items():
                    want = ref_states[step][int(idx)]
                    assert len(params) == len(want), (name, rank, idx)
                    where = f"{name}, rank {rank}, layer {idx}, step {step}"
                    for got, ref in zip(params, want, strict=True):
                        torch.testing.assert_close(torch.tensor(got), ref, rtol=1e-6, atol=1e-6,
                                                   msg=lambda m, where=where: f"{where}: {m}")
        if kind == "tied":  # the embedding and the head hold one weight: equal on both stages after every step
            first, last = 0, len(layers("tied")) - 1
            for step in range(STEPS):
                owners = {idx: results[r][c][1][step][idx] for r in range(world) for idx in (first, last)
                          if idx in results[r][c][1][step]}
                assert owners[first] == owners[last], (name, step)


def bad_inputs(rank, world):
    import ds_comm
    from ds_pipe import LayerSpec, PeerFailed, PipelineExecutor, PipelineModule

    def error(fn):
        try:
            fn()
        except (ValueError, RuntimeError) as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    out = {}
    few = [LayerSpec(nn.Linear, 4, 4)]
    out["stages > layers"] = error(lambda: PipelineModule(few, num_stages=2))
    out["bad bounds"] = error(lambda: PipelineModule(layers("plain"), num_stages=2, partition_method=[0, 4, 9]))
    out["bad method"] = error(lambda: PipelineModule(layers("plain"), num_stages=2, partition_method="type:Conv"))
    module = PipelineModule(layers("plain"), num_stages=2, loss_fn=token_loss, virtual_stages=2)
    out["interleaved m < p"] = error(lambda: PipelineExecutor(module, torch.optim.SGD(module.parameters()),
                                                              micro_batches=1, schedule="interleaved"))
    out["virtual without interleaved"] = error(lambda: PipelineExecutor(module, None, micro_batches=4))

    # a stage whose output changes shape at micro-batch 1: both ranks raise, neither hangs
    module = PipelineModule(layers("plain"), num_stages=2, loss_fn=token_loss)
    executor = PipelineExecutor(module, torch.optim.SGD(module.parameters(), lr=0.1), micro_batches=3)
    data = batches(0, 0, 1) + batches(0, 0, 2, rows=MB + 1)
    out["shape change"] = error(lambda: executor.train_batch(iter(data)))
    out["after a failure"] = error(lambda: executor.train_batch(iter(batches(0, 0, 3))))

    # the same with dynamic_shape=True trains (the new shapes travel with the message)
    module = PipelineModule(layers("plain"), num_stages=2, loss_fn=token_loss, dynamic_shape=True)
    executor = PipelineExecutor(module, torch.optim.SGD(module.parameters(), lr=0.1), micro_batches=3)
    out["dynamic shape"] = float(executor.train_batch(iter(data)))

    # no loss_fn and a last stage that returns logits
    module = PipelineModule(layers("plain"), num_stages=2)
    executor = PipelineExecutor(module, torch.optim.SGD(module.parameters(), lr=0.1), micro_batches=2)
    out["no loss_fn"] = error(lambda: executor.train_batch(iter(batches(0, 0, 2))))

    # the group still works: a fresh executor trains
    module = PipelineModule(layers("plain"), num_stages=2, loss_fn=token_loss)
    executor = PipelineExecutor(module, torch.optim.SGD(module.parameters(), lr=0.1), micro_batches=2)
    out["fresh"] = float(executor.train_batch(iter(batches(0, 0, 2))))
    assert issubclass(PeerFailed, RuntimeError)
    ds_comm.barrier()
    return out


def test_bad_input_is_named_on_every_rank_and_nothing_hangs():
    first, last = spawn(bad_inputs, world_size=2, timeout=120)
    for out in (first, last):
        assert out["stages > layers"] == ("ValueError: PipelineModule: 2 stages (num_stages=2 x virtual_stages=1) "
                                          "but only 1 layers; each stage needs a layer")
        assert out["bad bounds"] == ("ValueError: PipelineModule: partition_method [0, 4, 9] must be 3 strictly "
                                     "increasing boundaries from 0 to 10 (the number of layers), one part per stage")
        assert out["bad method"].startswith("ValueError: PipelineModule: partition_method 'type:Conv' matches no "
                                            "layer; layer types: ['Block', 'Embedding', 'Linear']")
        assert "1" in out["interleaved m < p"] and "2" in out["interleaved m < p"], out["interleaved m < p"]
        assert out["interleaved m < p"].startswith("ValueError"), out["interleaved m < p"]
        assert out["virtual without interleaved"].startswith("ValueError: PipelineExecutor: the module has "
                                                             "virtual_stages=2")
        assert out["after a failure"].startswith("RuntimeError: PipelineExecutor: an earlier batch failed")
        assert out["fresh"] > 0
    assert out["fresh"] == first["fresh"]
    assert first["dynamic shape"] == last["dynamic shape"] > 0
    shape = ("the activation of micro-batch 1 sent to stage 1 (rank 1) is float32[4, 5, 16], but earlier "
             "micro-batches sent float32[3, 5, 16]; a stage must keep its output's shapes and dtypes")
    assert first["shape change"].startswith("ValueError: ds_pipe: " + shape), first["shape change"]
    assert last["shape change"].startswith("PeerFailed: ds_pipe: a pipeline stage failed: stage 0 (rank 0): "
                                           "ValueError: ds_pipe: " + shape), last["shape change"]
    no_loss = "the last stage's output is not a scalar loss and the PipelineModule has no loss_fn"
    assert last["no loss_fn"].startswith("ValueError: ds_pipe: " + no_loss), last["no loss_fn"]
    assert first["no loss_fn"].startswith("PeerFailed: ds_pipe: a pipeline stage failed: stage 1 (rank 1)"), \
        first["no loss_fn"]
    assert no_loss in first["no loss_fn"]


def evaluate(rank, world):
    from ds_pipe import PipelineExecutor, PipelineModule
    module = PipelineModule(layers("plain"), num_stages=2, loss_fn=token_loss, seed_layers=True,
                            partition_method="uniform")
    executor = PipelineExecutor(module, torch.optim.SGD(module.parameters(), lr=0.1), micro_batches=3)
    loss, logits = executor.eval_batch(iter(batches(7, 0, 3)), return_logits=True)
    return float(loss), None if logits is None else [t.tolist() for t in logits]


def test_eval_batch_gives_the_unsplit_models_loss_and_logits():
    (loss0, logits0), (loss1, logits1) = spawn(evaluate, world_size=2)
    built = reference_model("plain")
    want_losses, want_logits = [], []
    with torch.no_grad():
        for x, y in batches(7, 0, 3):
            for module, _ in built:
                x = module(x)
            want_losses.append(token_loss(x, y).item())
            want_logits.append(x)
    assert loss0 == loss1 == pytest.approx(sum(want_losses) / 3, rel=1e-6)
    assert logits0 is None and len(logits1) == 3
    for got, want in zip(logits1, want_logits, strict=False):
        torch.testing.assert_close(torch.tensor(got), want, rtol=1e-6, atol=1e-6)


def test_partitions_balance_what_they_are_asked_to():
    from ds_pipe._module import partition_balanced, partition_uniform
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    assert partition_uniform(4, 4) == [0, 1, 2, 3, 4]
    for weights in ([1, 1, 1, 1, 10, 1], [5, 1, 1, 1, 1, 1, 1, 5], [3, 3, 3], [0, 0, 7, 0, 1, 1, 1, 1]):
        for parts in range(1, len(weights) + 1):
            bounds = partition_balanced(weights, parts)
            assert bounds[0] == 0 and bounds[-1] == len(weights) and len(bounds) == parts + 1
            assert all(a < b for a, b in itertools.pairwise(bounds))
            heaviest = max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))
            best = min(max(sum(weights[a:b]) for a, b in zip((0, *cuts), (*cuts, len(weights)), strict=False))
                       for cuts in itertools.combinations(range(1, len(weights)), parts - 1))
            assert heaviest == best, (weights, parts, bounds)


def test_pipeline_config_loads_deepspeed_keys_and_names_typos():
    from ds_pipe import PipelineConfig
    config = PipelineConfig.from_ds_config({"pipeline": {"stages": 2, "partition": "uniform",
                                                         "activation_checkpoint_interval": 1}})
    assert (config.stages, config.partition_method(), config.schedule) == (2, "uniform", "1f1b")
    assert PipelineConfig().partition_method() == "parameters"
    with pytest.raises(ValueError, match=r"pipeline\.schedul.*did you mean 'schedule'"):
        PipelineConfig.from_ds_config({"pipeline": {"schedul": "1f1b"}})
    with pytest.raises(ValueError, match="virtual_stages"):
        PipelineConfig(virtual_stages=0)


# the micro-batches' losses [1, 2^-24, 2^-24, 2^-24]: DeepSpeed's float32 running sum stays 1 (each 2^-24 is a
# tie rounded to even), so it reports 0.25; a float64 mean is 0.25 + 3 * 2^-26, which float32 rounds to 0.25 + 2^-25
SUMMED_LOSSES = [1.0, 2.0**-24, 2.0**-24, 2.0**-24]


def given_loss(out, value):
    return (out * 0).sum() + value


def losses_reported(rank, world):
    from ds_pipe import PipelineExecutor, PipelineModule
    module = PipelineModule([nn.Linear(2, 2), nn.Linear(2, 2)], num_stages=2, loss_fn=given_loss,
                            partition_method="uniform")
    executor = PipelineExecutor(module, torch.optim.SGD(module.parameters(), lr=0.1), micro_batches=4)

    def data():
        return iter([(torch.ones(1, 2), torch.tensor(v, dtype=torch.float32)) for v in SUMMED_LOSSES])
    return executor.train_batch(data()).item(), executor.eval_batch(data()).item()


def test_the_reported_loss_is_deepspeeds_float32_running_sum_over_the_micro_batches():
    """DeepSpeed's pipeline adds the micro-batches' losses in order in their dtype and divides by their count;
    the same bits here (a float64 mean is up to a few ulps away: the pipeline example's step 4 was 2 ulps off)."""
    total = torch.zeros((), dtype=torch.float32)
    for value in SUMMED_LOSSES:
        total += torch.tensor(value, dtype=torch.float32)
    deepspeeds = (total / len(SUMMED_LOSSES)).item()
    float64_mean = torch.tensor(sum(SUMMED_LOSSES) / len(SUMMED_LOSSES), dtype=torch.float64).float().item()
    assert deepspeeds != float64_mean  # the case tells the two apart
    for train, evaluated in spawn(losses_reported, world_size=2):
        assert train == deepspeeds and evaluated == deepspeeds
