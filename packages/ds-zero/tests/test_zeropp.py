"""ZeRO++ at stage 3 on 4 ranks as 2 nodes × 2 (LOCAL_WORLD_SIZE=2, gloo), against plain stage 3 on the
same model, data and seed: hpZ alone trains bit for bit as plain stage 3 (its secondary copies are exact)
with no backward gather crossing the node boundary; qwZ gathers a quarter of the bytes; qgZ sends under
0.3× the gradient bytes across nodes; each trains within the quantization's reach of plain stage 3; the
values users read (GatheredParameters, the whole parameters) are the shards' exact ones; and the keys'
refusals are DeepSpeed's."""

from __future__ import annotations

import copy
import importlib.util
import logging
import sys
from pathlib import Path

import pytest
import torch

import ds_comm
from ds_comm.testing import spawn
from ds_zero import GatheredParameters, ZeroOptimizer, load_zero_checkpoint, save_zero_checkpoint


def _sibling(name: str):
    spec = importlib.util.spec_from_file_location(f"_ds_zero_tests_{name}", Path(__file__).with_name(f"{name}.py"))
    module = sys.modules.get(spec.name) or importlib.util.module_from_spec(spec)
    if spec.name not in sys.modules:
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module


_gpt = _sibling("test_zero_vs_ddp")
TinyGPT, _batch = _gpt.TinyGPT, _gpt._batch
ADAMW = {"lr": 1e-2, "weight_decay": 0.01}
# backward gathers again (the regime ZeRO++ is for); no prefetch: each gather completes within its request, so
# the comms logger's count after the forward holds the forward's gathers exactly
STAGE3 = {"stage": 3, "stage3_param_persistence_threshold": 100, "stage3_prefetch_bucket_size": 0,
          "stage3_max_reuse_distance": 0}
TWO_BY_TWO = {"LOCAL_WORLD_SIZE": "2"}
CASES = {"plain": {}, "hpZ": {"zero_hpz_partition_size": 2},
         "hpZ, prefetch": {"zero_hpz_partition_size": 2, "stage3_prefetch_bucket_size": 5000},
         "qwZ": {"zero_quantized_weights": True},
         "qgZ": {"zero_quantized_gradients": True},
         "all": {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}}
STEPS = 12


def _traffic() -> dict[str, tuple[int, int]]:
    """Per op: (bytes, bytes crossing the node boundary) the comms logger counted so far."""
    out: dict[str, tuple[int, int]] = {}
    for r in ds_comm.comms_logger.records():
        total, cross = out.get(r.op, (0, 0))
        out[r.op] = (total + r.msg_bytes * r.count, cross + int(r.cross_node_bytes or 0))
    return out


def _minus(after: dict, before: dict) -> dict:
    return {op: (b - before.get(op, (0, 0))[0], c - before.get(op, (0, 0))[1]) for op, (b, c) in after.items()}


def train_each_way(rank, world_size):
    torch.manual_seed(0)
    base = TinyGPT()
    out = {}
    for name, extra in CASES.items():
        model = copy.deepcopy(base)
        zero = ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs=ADAMW, config={**STAGE3, **extra})
        losses, probe = [], {}

        def inside_forward(module, args, probe=probe):  # the head's unit is gathered for its forward (by qwZ: quantized)
            probe["module's"] = module.weight.detach().clone()
            with GatheredParameters([module.weight]):
                probe["held"] = module.weight.detach().clone()

        for step in range(STEPS):
            measured = step == 2  # (the trace is recorded: prefetches run as in training)
            if measured:
                ds_comm.configure(enabled=True, prof_all=True)
                ds_comm.comms_logger.reset()
            hook = model.head.register_forward_pre_hook(inside_forward) if step == 3 else None
            loss = model(_batch(step, 0, rank))
            if hook is not None:
                hook.remove()
                with GatheredParameters([model.head.weight]):  # released now: gathered exactly
                    probe["exact"] = model.head.weight.detach().clone()
            if measured:
                forward = _traffic()
            zero.backward(loss)
            if measured:
                backward = _minus(_traffic(), forward)
            zero.step()
            if measured:
                ds_comm.configure(enabled=False)
                whole_step = _traffic()
            zero.zero_grad()
            losses.append(loss.item())
        secondary = zero._stage3.gatherer.secondary_bytes()  # dropped at the end of each backward
        with GatheredParameters(list(model.parameters())):
            held = [p.detach().clone() for p in model.parameters()]
        zero.close()  # every parameter whole again
        whole = [p.detach().clone() for p in model.parameters()]
        out[name] = {"losses": losses, "forward": forward, "backward": backward, "step": whole_step, "held": held,
                     "whole": whole,
                     "secondary": secondary, "probe": probe}
    return out


@pytest.fixture(scope="module")
def runs():
    return spawn(train_each_way, world_size=4, env=TWO_BY_TWO, timeout=300)


def test_hpz_trains_bit_for_bit_as_stage_3_and_its_backward_gathers_stay_in_the_node(runs):
    for out in runs:
        plain, hpz = out["plain"], out["hpZ"]
        assert hpz["losses"] == plain["losses"]
        assert all(torch.equal(a, b) for a, b in zip(hpz["whole"], plain["whole"], strict=True))
        assert plain["backward"]["all_gather_bucket"][1] > 0  # plain stage 3's backward gathers cross nodes
        assert hpz["backward"]["all_gather_bucket"][1] == 0, hpz["backward"]
        assert hpz["backward"]["all_gather_bucket"][0] > 0  # (it did gather, inside the node)
        assert hpz["forward"] == plain["forward"]  # the forward's gathers are stage 3's
        assert hpz["secondary"] == 0
        # prefetching: the backward's units gathered ahead (from the forward's last module on) are gathered as
        # the backward gathers them, from the secondary copies
        prefetched = out["hpZ, prefetch"]
        assert prefetched["losses"] == plain["losses"]
        assert prefetched["step"]["all_gather_bucket"] == hpz["step"]["all_gather_bucket"]


def test_qwz_gathers_a_quarter_of_the_bytes_of_fp32(runs):
    for out in runs:
        plain, qwz = out["plain"], out["qwZ"]
        exact = plain["forward"]["all_gather_bucket"][0] + plain["backward"]["all_gather_bucket"][0]
        quantized = sum(way[op][0] for way in (qwz["forward"], qwz["backward"]) for op in way
                        if "all_gather" in op)
        assert "all_gather_bucket" not in qwz["backward"]
        assert quantized <= 0.27 * exact, (quantized, exact)


def test_qgz_sends_under_0_3_of_the_gradient_bytes_across_nodes(runs):
    for out in runs:
        plain = out["plain"]["backward"]["reduce_scatter_bucket"][1]
        qgz = out["qgZ"]["backward"]
        assert "reduce_scatter_bucket" not in qgz
        assert 0 < qgz["quantized_reduce_scatter"][1] <= 0.3 * plain, (qgz, plain)


def test_each_way_trains_within_the_quantizations_reach_of_stage_3(runs):
    for out in runs:
        plain = out["plain"]["losses"]
        for name in ("qwZ", "qgZ", "all"):
            losses = out[name]["losses"]
            assert losses != plain  # it did quantize
            gaps = [abs(a / b - 1) for a, b in zip(losses, plain, strict=True)]
            assert max(gaps) <= 0.01, (name, gaps)


def test_users_read_the_shards_exact_values(runs):
    """GatheredParameters (and so the 16-bit export, which holds each unit) reads exact values: after training,
    and inside a forward whose module holds the unit as qwZ gathered it."""
    for out in runs:
        for name in CASES:
            assert all(torch.equal(a, b) for a, b in zip(out[name]["held"], out[name]["whole"], strict=True)), name
            probe = out[name]["probe"]
            assert torch.equal(probe["held"], probe["exact"]), name
            assert torch.equal(probe["module's"], probe["exact"]) == ("qwZ" not in name and name != "all"), name


def _steps(model, zero, start, stop, rank):
    for step in range(start, stop):
        zero.backward(model(_batch(step, 0, rank)))
        zero.step()
        zero.zero_grad()


def _gathered(model):
    with GatheredParameters(list(model.parameters())):
        return [p.detach().clone() for p in model.parameters()]


def resumed(rank, world_size, path):
    torch.manual_seed(0)
    base = TinyGPT()
    model = copy.deepcopy(base)
    zero = ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs=ADAMW, config={**STAGE3, **CASES["all"]})
    _steps(model, zero, 0, 3, rank)
    at_save = _gathered(model)
    save_zero_checkpoint(zero, path)
    _steps(model, zero, 3, 6, rank)
    uninterrupted = _gathered(model)
    torch.manual_seed(123)  # another init: everything comes from the checkpoint
    again = TinyGPT()
    zero2 = ZeroOptimizer(again, torch.optim.AdamW, optimizer_kwargs=ADAMW, config={**STAGE3, **CASES["all"]})
    load_zero_checkpoint(zero2, path)
    _steps(again, zero2, 3, 6, rank)
    torch.manual_seed(123)
    plain = TinyGPT()  # plain stage 3 reads the same checkpoint: it holds exact values, no ZeRO++ state
    zero3 = ZeroOptimizer(plain, torch.optim.AdamW, optimizer_kwargs=ADAMW, config=STAGE3)
    load_zero_checkpoint(zero3, path)
    return (all(torch.equal(a, b) for a, b in zip(uninterrupted, _gathered(again), strict=True)),
            all(torch.equal(a, b) for a, b in zip(at_save, _gathered(plain), strict=True)))


def test_a_zeropp_run_resumes_bit_for_bit_from_a_checkpoint_plain_stage_3_reads(tmp_path):
    assert spawn(resumed, world_size=4, args=(str(tmp_path / "ck"),), env=TWO_BY_TWO, timeout=300) == [(True, True)] * 4


def mixz(rank, world_size):
    """MixZ++: TinyGPT with frozen embeddings (a fine-tuning's frozen base), stored quantized."""
    torch.manual_seed(0)
    base = TinyGPT()
    base.tok.requires_grad_(False)
    base.pos.requires_grad_(False)
    original = base.tok.weight.detach().clone()
    out = {}
    for name, extra in (("plain", {}), ("MixZ++", {"zero_quantized_nontrainable_weights": True})):
        model = copy.deepcopy(base)
        zero = ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs=ADAMW, config={**STAGE3, **extra})
        with GatheredParameters([model.tok.weight]):
            first = model.tok.weight.detach().clone()
        ds_comm.configure(enabled=True, prof_all=True)
        ds_comm.comms_logger.reset()
        losses = []
        for step in range(6):
            loss = model(_batch(step, 0, rank))
            zero.backward(loss)
            zero.step()
            zero.zero_grad()
            losses.append(loss.item())
        ops = set(_traffic())
        ds_comm.configure(enabled=False)
        with GatheredParameters([model.tok.weight]):
            last = model.tok.weight.detach().clone()
        out[name] = {"losses": losses, "ops": ops, "params_bytes": zero.memory_bytes()["params"],
                     "error": float((first - original).abs().max()), "kept": torch.equal(first, last)}
        zero.close()
    out["bound"] = float(original.abs().max()) / 127 / 2 * (1 + 2**-15)
    return out


def test_mixz_stores_frozen_weights_as_int8_and_gathers_them_quantized():
    for out in spawn(mixz, world_size=4, env=TWO_BY_TWO, timeout=300):
        plain, mixz_ = out["plain"], out["MixZ++"]
        assert plain["error"] == 0 and 0 < mixz_["error"] <= out["bound"]  # the frozen weights are the int8 ones
        assert plain["kept"] and mixz_["kept"]  # (and stay so: nothing steps them)
        # this rank's frozen shard, 2560 / 4 elements: float32 4 bytes each, int8 1 byte plus its scale
        assert plain["params_bytes"] - mixz_["params_bytes"] >= 0.7 * 2560
        assert "quantized_all_gather" in mixz_["ops"] and "quantized_all_gather" not in plain["ops"]
        assert mixz_["losses"] != plain["losses"]
        assert all(abs(a / b - 1) <= 0.01 for a, b in zip(mixz_["losses"], plain["losses"], strict=True))


def refusals(rank, world_size):
    out = []
    model = TinyGPT()
    for extra, error in (({"zero_hpz_partition_size": 3}, ValueError),):
        try:
            ZeroOptimizer(copy.deepcopy(model), torch.optim.AdamW, config={**STAGE3, **extra})
        except error as e:
            out.append(str(e))
    return out


def test_refusals_name_the_value_and_the_rule():
    (hpz,) = spawn(refusals, world_size=4)[0]
    assert hpz == ("zero_optimization.zero_hpz_partition_size 3 must divide the world size 4 (DeepSpeed's rule: "
                   "each secondary partition is hpz consecutive ranks)")


def below_stage_3(rank, world_size):
    model = TinyGPT()
    zero = ZeroOptimizer(model, torch.optim.AdamW, config={"stage": 2, **CASES["all"]})
    loss = model(_batch(0, 0, rank))
    zero.backward(loss)
    zero.step()
    return zero.policy.zeropp.on


def test_below_stage_3_the_keys_change_nothing_and_say_so(caplog):
    with caplog.at_level(logging.WARNING, logger="ds_zero._zeropp"):
        from ds_zero._zeropp import zeropp_of
        from ds_zero.config import ZeroConfig

        assert not zeropp_of(ZeroConfig.from_section_or_ds_config({"stage": 2, **CASES["all"]}), False).on
    assert "apply at stage 3 only; at stage 2 they change nothing (as in DeepSpeed)" in caplog.text
    assert spawn(below_stage_3, world_size=2) == [False, False]


def cuda_zeropp(rank, world_size):
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    base = TinyGPT().cuda()
    out = {}
    for name in ("plain", "all"):
        model = copy.deepcopy(base)
        zero = ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs=ADAMW, config={**STAGE3, **CASES[name]})
        losses = []
        for step in range(6):
            loss = model(_batch(step, 0, rank).cuda())
            zero.backward(loss)
            zero.step()
            zero.zero_grad()
            losses.append(loss.item())
        out[name] = losses
        zero.close()
    return out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_zeropp_trains_on_the_gpu_within_the_quantizations_reach():
    out = spawn(cuda_zeropp, world_size=1, backend="nccl")[0]
    assert out["all"] != out["plain"]
    assert all(abs(a / b - 1) <= 0.01 for a, b in zip(out["all"], out["plain"], strict=True)), out
