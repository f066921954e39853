"""ZeRO stage 3 on 2 ranks: parameters equal to DDP's after 20 steps (bit for bit in float32), model
states at 16/N bytes per parameter, Init, GatheredParameters, external parameters, paths that change
between steps (the same on every rank) and paths that differ between ranks (a clear error)."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ds_comm
from ds_comm.testing import spawn
from ds_zero import (
    GatheredParameters,
    Init,
    ZeroOptimizer,
    estimate_zero_model_states_mem_needs,
    register_external_parameter,
)


def _sibling(name: str):
    """A module of this directory (the tests run with --import-mode=importlib: no package, no path)."""
    spec = importlib.util.spec_from_file_location(f"_ds_zero_tests_{name}", Path(__file__).with_name(f"{name}.py"))
    module = sys.modules.get(spec.name) or importlib.util.module_from_spec(spec)
    if spec.name not in sys.modules:
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module


_gpt = _sibling("test_zero_vs_ddp")
VOCAB, TinyGPT, _batch, _ddp = _gpt.VOCAB, _gpt.TinyGPT, _gpt._batch, _gpt._ddp
ADAMW = {"lr": 1e-2, "weight_decay": 0.01}
# tiny units: without a lower persistence threshold every unit of these models would stay whole
STAGE3 = {"stage": 3, "stage3_param_persistence_threshold": 100, "stage3_prefetch_bucket_size": 5000}


def _train(model, zero, steps, rank, batch=_batch):
    losses = []
    for step in range(steps):
        loss = model(batch(step, 0, rank))
        zero.backward(loss)
        zero.step()
        zero.zero_grad()
        losses.append(loss.item())
    return losses


def _whole(model, zero):
    zero.close()  # stage 3: every parameter whole again
    return [p.detach().clone() for p in model.parameters()]


def against_ddp(rank, world_size):
    torch.manual_seed(0)
    base = TinyGPT()
    reference, _ = _ddp(copy.deepcopy(base), 20, 1, 0.0)
    out = {}
    cases = {"default": {}, "reuse 0": {"stage3_max_reuse_distance": 0},
             "no prefetch": {"stage3_prefetch_bucket_size": 0, "stage3_max_live_parameters": 0},
             "offload": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}
    for name, extra in cases.items():
        model = copy.deepcopy(base)
        zero = ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs=ADAMW, config={**STAGE3, **extra})
        _train(model, zero, 20, rank)
        gathers = zero._stage3.gathers
        params = _whole(model, zero)
        out[name] = (all(torch.equal(a, b) for a, b in zip(params, reference, strict=True)),
                     max(float((a - b).abs().max()) for a, b in zip(params, reference, strict=True)), gathers)
    return out


@pytest.mark.slow
def test_stage_3_equals_ddp_after_20_steps():
    for out in spawn(against_ddp, world_size=2):
        for name in ("default", "reuse 0", "no prefetch"):
            assert out[name][0], (name, out[name])
        # ds_ops' CPU Adam rounds differently from torch's AdamW
        assert out["offload"][1] < 1e-5, out["offload"]
        # units are gathered again each step (14 units, 5 persistent: LayerNorms) in forward and backward
        assert out["reuse 0"][2] > 20 * 9, out


def memory(rank, world_size, precision):
    sections = {"bf16": {"enabled": precision == "bf16"}}
    model = TinyGPT()
    zero = ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs=ADAMW, **sections,
                         config={**STAGE3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0})
    _train(model, zero, 2, rank)
    during = {}

    def look(module, args, output):
        during.setdefault("gathered", zero._stage3.held_bytes())

    handle = model.blocks[1].mlp[0].register_forward_pre_hook(lambda module, args: look(module, args, None))
    _train(model, zero, 1, rank)
    handle.remove()
    return zero.memory_bytes(), during["gathered"], sum(s.numel for s in zero.layout.slots)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_model_states_are_16_bytes_per_parameter_over_n(precision):
    for got, gathered, psi in spawn(memory, world_size=2, args=(precision,)):
        estimate = estimate_zero_model_states_mem_needs(psi, stage=3, world_size=2, precision=precision)
        for kind in ("params", "grads", "master", "optimizer"):
            assert abs(got[kind] - estimate[kind]) <= 0.01 * max(estimate[kind], 1) + 64, (kind, got, estimate)
        total = sum(got[k] for k in ("params", "grads", "master", "optimizer")) / psi
        assert 7.9 < total < 8.2, (got, psi)
        # in a forward only the units in use and those prefetched are whole (the reuse distance is 0)
        assert 0 < gathered < 0.5 * psi * (4 if precision == "fp32" else 2), gathered


class Branchy(nn.Module):
    """Block 0 runs twice; block 1 runs on even steps only (``self.skip`` set by the loop, the same on
    every rank unless a test says otherwise); the LM head is the token embedding (tied, read by the
    root through F.linear, so registered as an external parameter)."""

    def __init__(self):
        super().__init__()
        base = TinyGPT()
        self.tok, self.pos, self.blocks, self.norm = base.tok, base.pos, base.blocks, base.norm
        self.skip = False
        register_external_parameter(self, self.tok.weight)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        x = self.blocks[0](self.blocks[0](x))
        if not self.skip:
            x = self.blocks[1](x)
        logits = F.linear(self.norm(x), self.tok.weight)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def changing_paths(rank, world_size):
    results = {}
    for stage in (2, 3):
        torch.manual_seed(0)
        model = Branchy()
        config = STAGE3 if stage == 3 else {"stage": 2, "reduce_bucket_size": 2000}
        zero = ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs=ADAMW, config=config)
        losses = []
        for step in range(8):
            model.skip = step % 3 == 1
            losses += _train(model, zero, 1, rank, batch=lambda s, m, r, step=step: _batch(step, m, r))
        results[stage] = (_whole(model, zero) if stage == 3 else [p.detach().clone() for p in model.parameters()],
                          losses)
    same = all(torch.equal(a, b) for a, b in zip(results[2][0], results[3][0], strict=True))
    return same, results[2][1] == results[3][1]


def test_paths_that_change_between_steps_and_modules_called_twice():
    # stage 2 equals DDP bit for bit; stage 3 must equal stage 2 with a path that changes every few
    # steps (the prefetch trace is re-recorded), a block called twice per step and a tied weight
    for same, same_losses in spawn(changing_paths, world_size=2):
        assert same and same_losses


def diverging(rank, world_size):
    torch.manual_seed(0)
    model = Branchy()
    zero = ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs=ADAMW, config=STAGE3)
    _train(model, zero, 2, rank)
    model.skip = rank == 1  # rank 1 leaves block 1 out
    try:
        _train(model, zero, 1, rank)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_ranks_that_take_different_paths_get_an_error_naming_the_modules():
    messages = spawn(diverging, world_size=2, timeout=120)
    # rank 0 asks for block 1's attention (its LayerNorms stay whole: no request); rank 1 has ended
    assert messages[0] == messages[1], messages
    assert "the ranks took different paths through the model (rank 0: the parameters of 'blocks.1.attn' " \
           "(forward); rank 1: the end of the forward)" in messages[0], messages


def built_under_init(rank, world_size):
    torch.manual_seed(0)
    plain = TinyGPT()
    torch.manual_seed(0)
    with Init():
        model = TinyGPT()
    shards = {name: (p.numel(), p.ds_tensor.numel(), p.ds_numel) for name, p in model.named_parameters()}
    # GatheredParameters on Init's shards: read whole, modify on rank 0, partitioned again
    with GatheredParameters(model.head.weight, modifier_rank=0):
        whole_head = torch.equal(model.head.weight, plain.head.weight)
        if rank == 0:
            model.head.weight.data.mul_(2)
    with GatheredParameters([model.head.weight]):
        doubled = torch.equal(model.head.weight, 2 * plain.head.weight)
        model.head.weight.data.zero_()  # no modifier: discarded
    with torch.no_grad():
        plain.head.weight.mul_(2)
    zero_plain = ZeroOptimizer(plain, torch.optim.AdamW, optimizer_kwargs=ADAMW, config=STAGE3)
    zero_init = ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs=ADAMW, config=STAGE3)
    a, b = _train(plain, zero_plain, 5, rank), _train(model, zero_init, 5, rank)
    # GatheredParameters on stage 3's units: the modification reaches every rank and the next step
    with GatheredParameters(model.tok.weight, modifier_rank=1):
        if rank == 1:
            model.tok.weight.data.fill_(0.25)
    with GatheredParameters(model.tok.weight):
        filled = bool((model.tok.weight == 0.25).all())
    pairs = list(zip(_whole(plain, zero_plain), _whole(model, zero_init), strict=True))[1:]  # tok is 0.25 now
    return shards, whole_head, doubled, a == b, all(torch.equal(x, y) for x, y in pairs), filled


def test_init_builds_partitioned_and_gathered_parameters_round_trip():
    for shards, whole_head, doubled, same_losses, same_params, filled in spawn(built_under_init, world_size=2):
        for name, (numel, held, total) in shards.items():  # as DeepSpeed's: empty, the shard in ds_tensor
            assert numel == 0 and held == -(-total // 2), (name, numel, held, total)  # never whole on any rank
        assert whole_head and doubled and filled
        assert same_losses and same_params


def _proc_status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def _peak_growth_mib(build):
    """``build()`` and how far this process's peak RSS rose above its RSS before (VmHWM, reset first)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _proc_status_mib("VmRSS")
    built = build()
    return built, _proc_status_mib("VmHWM") - before


def construction_peak(rank, world_size, layers, width, under_init):
    def build():
        if not under_init:
            return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
        with Init(config_dict_or_path={"zero_optimization": {"stage": 3}}):
            return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])

    ds_comm.barrier()
    model, peak = _peak_growth_mib(build)
    held = [getattr(p, "ds_tensor", p) for p in model.parameters()]  # under Init: the shard (DeepSpeed's ds_tensor)
    return peak, sum(t.numel() * t.element_size() for t in held) / 2**20


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_init_peak_memory_is_half_the_model_plus_a_layer():
    # 64 MiB a layer, 512 MiB in all: above glibc's largest mmap threshold (32 MiB), so a freed layer goes back
    # to the system (smaller ones stay in the heap, and reusing those holes is the allocator's business)
    layers, width = 8, 4096
    layer, full = width * width * 4 / 2**20, layers * width * width * 4 / 2**20
    # the control, in processes of its own (freed memory stays with the allocator): built whole, the
    # measurement sees the whole model
    for peak, held in spawn(construction_peak, world_size=2, args=(layers, width, False)):
        assert held == full and peak >= 0.9 * full, peak
    for peak, held in spawn(construction_peak, world_size=2, args=(layers, width, True)):
        assert held == full / 2
        assert peak <= full / 2 + 2 * layer, peak  # this rank's halves, the layer being built and its broadcast


def refusals(rank, world_size):
    out = []
    try:
        ZeroOptimizer(nn.Linear(4, 4), config={"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}})
    except NotImplementedError as e:
        out.append(str(e))
    try:  # nowhere to write
        Init(remote_device="nvme")
    except ValueError as e:
        out.append(str(e))
    try:
        with GatheredParameters(nn.Linear(2, 2).weight, modifier_rank=-1):
            pass
    except ValueError as e:
        out.append(str(e))
    ds_comm.barrier()
    return out


def test_what_is_not_built_yet_is_refused_by_name():
    for messages in spawn(refusals, world_size=2):
        assert len(messages) == 3, messages
        assert "offload_param.device 'nvme' needs offload_optimizer.device 'nvme' too" in messages[0]
        assert "remote_device 'nvme' writes the parameters' slices under the config's " \
               "zero_optimization.offload_param.nvme_path" in messages[1], messages[1]
        assert "modifier_rank" in messages[2]


def _partition_states(zero) -> dict[str, torch.Tensor]:
    """Adam's states of this rank's partition, in partition order (CPU offload keeps them per bucket)."""
    if zero._nvme is not None:
        return zero._nvme.read_all()
    return {key: torch.cat([zero.optimizer.state[t][key] for t in zero._step_params]) for key in ("exp_avg",
                                                                                                  "exp_avg_sq")}


# Not a multiple of 8 or 16: every chunk NVMe offload steps ends mid-vector on AVX2 and AVX-512 alike, where CPU
# offload's runs (multiples of 16) end on whole vectors, so the two paths agree only if the kernel steps an element
# the same wherever its span ends (3000 = 187 x 16 + 8 once failed on AVX-512 CPUs alone).
SUB_GROUP = 3004


def nvme_against_cpu(rank, world_size, path, pipeline):
    torch.manual_seed(0)
    base = TinyGPT()
    runs = {}
    for device in ("cpu", "nvme"):
        model = copy.deepcopy(base)
        offload = {"device": device, "nvme_path": path, "pipeline_read": pipeline, "pipeline_write": pipeline}
        # small sub-groups: a partition of ~15k elements is stepped in 5 chunks, each ending mid-vector (SUB_GROUP)
        zero = ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs=ADAMW,
                             config={**STAGE3, "sub_group_size": SUB_GROUP, "offload_optimizer": offload})
        _train(model, zero, 6, rank)
        memory = zero.memory_bytes()
        states = _partition_states(zero)
        files = sorted(p.name for p in zero._nvme.directory.iterdir()) if zero._nvme is not None else []
        runs[device] = (_whole(model, zero), states, memory, files)
    params_equal = all(torch.equal(a, b) for a, b in zip(runs["cpu"][0], runs["nvme"][0], strict=True))
    states_equal = all(torch.equal(runs["cpu"][1][k], runs["nvme"][1][k]) for k in ("exp_avg", "exp_avg_sq"))
    return params_equal, states_equal, runs["cpu"][2], runs["nvme"][2], runs["nvme"][3]


@pytest.mark.parametrize("pipeline", [False, True])
def test_optimizer_states_on_nvme_read_back_identical(tmp_path, pipeline):
    for params_equal, states_equal, cpu, nvme, files in spawn(nvme_against_cpu, world_size=2,
                                                              args=(str(tmp_path), pipeline)):
        # every byte written is read back identical: the same update as CPU offload, states equal bit
        # for bit after 6 steps, and the run's files are gone after close()
        assert params_equal and states_equal
        assert nvme["nvme"] == cpu["optimizer"]  # every state byte on disk...
        assert nvme["optimizer"] == (2 if pipeline else 1) * 2 * SUB_GROUP * 4 < cpu["optimizer"]  # ...chunk buffers in RAM
        assert len([f for f in files if f.endswith(".swp")]) == 2 * 5, files
    assert not list(tmp_path.glob("ds_zero_optimizer_*"))


def nvme_refusals(rank, world_size, path):
    import shutil

    out = []
    config = {**STAGE3, "offload_optimizer": {"device": "nvme", "nvme_path": path}}
    try:  # a path that cannot be a directory (a file is in the way)
        ZeroOptimizer(TinyGPT(), torch.optim.AdamW, config={**config, "offload_optimizer": {
            "device": "nvme", "nvme_path": str(Path(path) / "file" / "sub")}})
    except OSError as e:
        out.append(str(e))
    try:  # refused after the files were made (CPU Adam only): they go with the half-built optimizer
        ZeroOptimizer(TinyGPT(), torch.optim.SGD, optimizer_kwargs={"lr": 0.1}, config=config)
    except ValueError as e:
        out.append(str(e))
    import gc

    gc.collect()  # the exception (and the frame of the half-built optimizer) is gone
    out[-1] += f" | left: {[p.name for p in Path(path).glob(f'ds_zero_optimizer_rank{rank}_*')]}"  # its own
    real = shutil.disk_usage
    shutil.disk_usage = lambda p: real(p)._replace(free=1000)  # a disk with 1000 bytes left
    try:
        ZeroOptimizer(TinyGPT(), torch.optim.AdamW, config=config)
    except OSError as e:
        out.append(str(e))
    try:  # Init(remote_device="nvme"): the first slice larger than what is left
        with Init(config_dict_or_path={"zero_optimization": {**config, "offload_param": {
                "device": "nvme", "nvme_path": path}}}):
            TinyGPT()
    except OSError as e:
        out.append(str(e))
    finally:
        shutil.disk_usage = real
    ds_comm.barrier()
    return out


def test_an_unwritable_or_full_nvme_path_is_an_error_before_training(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    for messages in spawn(nvme_refusals, world_size=2, args=(str(tmp_path),)):
        assert len(messages) == 4, messages
        assert f"nvme_path '{tmp_path}/file/sub' is not a writable directory" in messages[0], messages[0]
        assert "offload_optimizer steps Adam or AdamW" in messages[1] and messages[1].endswith("| left: []"), \
            messages[1]
        assert f"nvme_path '{tmp_path}' has 1000 bytes free" in messages[2] and "bytes (" in messages[2], messages[2]
        assert f"nvme_path '{tmp_path}' has 1000 bytes free; ds_zero.Init(remote_device='nvme') needs " \
               "4096 bytes more for a slice of a (64, 32) parameter" in messages[3], messages[3]


class Checkpointed(nn.Module):
    """TinyGPT whose blocks run under torch.utils.checkpoint (recomputed in backward)."""

    def __init__(self):
        super().__init__()
        self.gpt = TinyGPT()

    def forward(self, tokens):
        gpt = self.gpt
        x = gpt.tok(tokens) + gpt.pos(torch.arange(tokens.shape[1]))
        for block in gpt.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        logits = gpt.head(gpt.norm(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def checkpointed_and_evaluated(rank, world_size):
    runs = {}
    for stage in (2, 3):
        torch.manual_seed(0)
        model = Checkpointed()
        config = STAGE3 if stage == 3 else {"stage": 2, "reduce_bucket_size": 2000}
        zero = ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs=ADAMW, config=config)
        evaluations = []
        for step in range(4):
            _train(model, zero, 1, rank, batch=lambda s, m, r, step=step: _batch(step, m, r))
            with torch.no_grad():  # an evaluation between steps: no backward follows this forward
                evaluations.append(model(_batch(100, 0, rank)).item())
        params = _whole(model, zero) if stage == 3 else [p.detach().clone() for p in model.parameters()]
        runs[stage] = (params, evaluations)
    same = all(torch.equal(a, b) for a, b in zip(runs[2][0], runs[3][0], strict=True))
    return same, runs[2][1] == runs[3][1]


def test_activation_checkpointing_and_evaluation_forwards_at_stage_3():
    # blocks recomputed in backward gather their units again; a no_grad forward between steps gathers
    # and releases without a backward: the same parameters and evaluation losses as stage 2
    for same, same_evaluations in spawn(checkpointed_and_evaluated, world_size=2):
        assert same and same_evaluations


def parameters_on_nvme(rank, world_size, path, precision):
    torch.manual_seed(0)
    base = TinyGPT().to(torch.bfloat16 if precision == "bf16" else torch.float32)  # bf16: same start for both
    runs = {}
    for device in ("cpu", "nvme"):
        model = copy.deepcopy(base)
        offload = {"device": device, "nvme_path": path, "pipeline_read": True, "pipeline_write": True}
        zero = ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs=ADAMW, bf16={"enabled": precision == "bf16"},
                             config={**STAGE3, "sub_group_size": 4096, "offload_optimizer": offload,
                                     "offload_param": {"device": device, "nvme_path": path}})
        losses = _train(model, zero, 5, rank)
        memory = {**zero.memory_bytes(), "partition": zero._flat.untyped_storage().nbytes()}
        runs[device] = (_whole(model, zero), losses, memory)
    same = all(torch.equal(a, b) for a, b in zip(runs["cpu"][0], runs["nvme"][0], strict=True))
    return same, runs["cpu"][1] == runs["nvme"][1], runs["cpu"][2], runs["nvme"][2]


class WideLM(nn.Module):
    """A next-token model of wide layers (ZeRO-Infinity's test: shards much larger than their 4 KiB
    alignment, so the bytes measured are the model's, not padding)."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, 256)
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
                                  for _ in range(4))
        self.head = nn.Linear(256, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.tok(tokens)
        for mlp in self.mlps:
            x = x + mlp(x)
        logits = self.head(x)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def infinity_scaled_down(rank, world_size, path):
    """ZeRO-Infinity in small: a model built under Init(remote_device="nvme") (the default with the
    config's offload_param on NVMe), trained with parameters and optimizer on NVMe."""
    import gc

    adamw = {"lr": 1e-3, "weight_decay": 0.01}

    def one_batch(step, micro, rank):  # the same batch every step: the loss must fall
        return _batch(0, micro, rank)

    torch.manual_seed(0)
    plain = WideLM()
    numel = sum(p.numel() for p in plain.parameters())
    # what Infinity runs with: units released after use, prefetch within a live budget of ~2 units
    config = {**STAGE3, "sub_group_size": 16384, "stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 6e5,
              "offload_optimizer": {"device": "nvme", "nvme_path": path, "pipeline_read": True, "pipeline_write": True},
              "offload_param": {"device": "nvme", "nvme_path": path}}
    torch.manual_seed(0)
    init = Init(config_dict_or_path={"zero_optimization": config})
    with init:
        model = WideLM()
    in_ram = sum(p.numel() for p in model.parameters())  # 0: every slice is on disk
    on_disk = init._store.bytes
    files = len(list(init._store.directory.iterdir()))
    with GatheredParameters(model.head.weight, modifier_rank=0):  # a modification round-trips through the file
        whole = torch.equal(model.head.weight, plain.head.weight)
        if rank == 0:
            model.head.weight.data.mul_(2)
    with torch.no_grad():
        plain.head.weight.mul_(2)
    with GatheredParameters(model.head.weight):
        doubled = torch.equal(model.head.weight, plain.head.weight)
    directory = init._store.directory
    del init
    zero = ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs=adamw, config=config)
    gc.collect()
    init_files_left = directory.exists()
    losses = _train(model, zero, 5, rank, one_batch)
    # the budget: fp32 Adam's model states are 16 bytes per parameter, 16 * numel / world per rank at
    # stage 3; RAM must hold less than half of that after training (the gradient partition, 4 bytes
    # per parameter / world, two reduction buffers of the largest unit, the chunk buffers, released gather
    # buffers kept for reuse), the disk the rest
    memory = zero.memory_bytes()
    ram = sum(v for k, v in memory.items() if k != "nvme")
    reference = ZeroOptimizer(plain, torch.optim.AdamW, optimizer_kwargs=adamw, config={
        **STAGE3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}})
    same_losses = losses == _train(plain, reference, 5, rank, one_batch)
    same = all(torch.equal(a, b) for a, b in zip(_whole(model, zero), _whole(plain, reference), strict=True))
    return (in_ram, on_disk, files, numel, whole, doubled, init_files_left, ram, memory["nvme"], same_losses,
            same, losses)


def test_infinity_scaled_down_model_states_beyond_a_ram_budget(tmp_path):
    for (in_ram, on_disk, files, numel, whole, doubled, init_files_left, ram, nvme, same_losses, same,
         losses) in spawn(infinity_scaled_down, world_size=2, args=(str(tmp_path),)):
        assert in_ram == 0 and files == len(list(WideLM().parameters()))
        assert 4 * numel / 2 <= on_disk <= 4 * numel / 2 + 4 * len(list(WideLM().parameters()))  # half, padded
        assert whole and doubled and not init_files_left
        budget = 16 * numel / 2 / 2
        assert ram < budget < nvme, (ram, budget, nvme)
        assert losses[-1] < losses[0] and same_losses and same
    assert not list(tmp_path.iterdir())  # every file removed


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_parameters_and_optimizer_on_nvme_train_as_with_cpu_offload(tmp_path, precision):
    for same, same_losses, cpu, nvme in spawn(parameters_on_nvme, world_size=2, args=(str(tmp_path), precision)):
        assert same and same_losses
        # RAM keeps no parameter partition (only the persistent LayerNorms, whole) and no optimizer state
        # but its chunk buffers; the disk holds it all (shards padded to 4 KiB for O_DIRECT)
        assert nvme["partition"] == 0 < cpu["partition"], (nvme, cpu)
        assert nvme["nvme"] >= cpu["partition"] + cpu["optimizer"] + cpu["master"], (nvme, cpu)
    assert not list(tmp_path.glob("ds_zero_optimizer_*"))


def over_one_of_two_data_groups(rank, world_size):
    import torch.distributed as dist

    # as beside tensor parallelism: data groups {0, 2} and {1, 3}, made on every rank in the same order
    groups = [ds_comm.new_group([0, 2]), ds_comm.new_group([1, 3])]
    mine = groups[rank % 2]
    out = []
    for _ in range(2):  # twice: the second optimizer reuses the check groups
        torch.manual_seed(0)
        model = TinyGPT()
        zero = ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs=ADAMW, config=STAGE3, group=mine)
        check = zero._stage3._check_group
        wired = torch.tensor([float(rank + 1)])
        dist.all_reduce(wired, group=check)  # connected to its data group's ranks, not another group's
        losses = _train(model, zero, 3, rank // 2)  # the same batches in both groups
        out.append((dist.get_process_group_ranks(check), float(wired), losses, _whole(model, zero), check))
    (ranks, wired, losses, params, check), (_, _, again, params_again, check_again) = out
    return ranks, wired, losses == again, check is check_again, params, params_again


def test_stage_3_over_one_of_several_data_groups():
    """Each rank's path checks run on a group of its data group's ranks, made on every rank for every data
    group in the same order: made for its own group alone, ranks of other groups were cross-wired (hung)."""
    results = spawn(over_one_of_two_data_groups, world_size=4, timeout=120)
    for rank, (ranks, wired, same_losses, reused, params, params_again) in enumerate(results):
        assert ranks == [rank % 2, rank % 2 + 2] and wired == sum(r + 1 for r in ranks)
        assert same_losses and reused
        assert all(torch.equal(a, b) for a, b in zip(params, params_again, strict=True))
        # both data groups trained the same model on the same batches
        assert all(torch.equal(a, b) for a, b in zip(params, results[rank ^ 1][4], strict=True))
