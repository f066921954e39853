"""What the CPU optimizers share: input checks, state handling, batching tensors into one kernel call."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from itertools import chain

import torch

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
STATE_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def check_hyperparameters(name: str, lr: float, eps: float | None = None, betas: tuple | None = None,
                          weight_decay: float = 0.0) -> None:
    if not lr >= 0.0:
        raise ValueError(f"{name}: lr must be >= 0, got {lr}")
    if eps is not None and not eps >= 0.0:
        raise ValueError(f"{name}: eps must be >= 0, got {eps}")
    if betas is not None and (len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"{name}: betas must be two numbers in [0, 1), got {betas}")
    if not weight_decay >= 0.0:
        raise ValueError(f"{name}: weight_decay must be >= 0, got {weight_decay}")


def check_state_dtype(name: str, dtype) -> torch.dtype:
    if dtype not in STATE_DTYPES:
        raise ValueError(f"{name}: state_dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    return dtype


def resolve_state_dtype(name: str, state_dtype, fp32_optimizer_states: bool | None) -> str:
    """The group's ``state_dtype`` entry from our ``state_dtype`` and DeepSpeed's
    ``fp32_optimizer_states``: "float32", "bfloat16", or "param" (DeepSpeed's
    ``fp32_optimizer_states=False``: each state in its parameter's dtype)."""
    if fp32_optimizer_states is not None and not isinstance(fp32_optimizer_states, bool):
        raise ValueError(f"{name}: fp32_optimizer_states must be True or False, got {fp32_optimizer_states!r}")
    if state_dtype is None:
        return "param" if fp32_optimizer_states is False else "float32"
    check_state_dtype(name, state_dtype)
    if fp32_optimizer_states is not None and fp32_optimizer_states != (state_dtype == torch.float32):
        raise ValueError(f"{name}: fp32_optimizer_states={fp32_optimizer_states} contradicts state_dtype={state_dtype}; "
                         "pass one of them")
    return STATE_DTYPES[state_dtype]


HALF_DTYPES = (torch.float16, torch.bfloat16)


def check_cpu_param(name: str, p: torch.Tensor, half_params: bool = False) -> None:
    """A parameter and its gradient as the CPU kernels take them. ``half_params``: the optimizer
    also updates float16/bfloat16 parameters in place (CPUAdam), with gradients of their dtype."""
    where = f"{name}: parameter of shape {tuple(p.shape)}"
    if p.device.type != "cpu":
        raise ValueError(f"{where} is on {p.device}; this optimizer updates CPU tensors "
                         "(FusedAdam/FusedLamb take device tensors)")
    if p.dtype != torch.float32 and not (half_params and p.dtype in HALF_DTYPES):
        if half_params:
            raise ValueError(f"{where} is {p.dtype}; {name} updates float32, bfloat16 or float16 parameters")
        raise ValueError(f"{where} is {p.dtype}; {name} updates float32 parameters only. Keep float32 master "
                         "weights for the optimizer (e.g. model.float(), or a float32 copy of each 16-bit "
                         "parameter) and copy them into the 16-bit model after each step; CPUAdam and CPULion "
                         "also update bfloat16/float16 parameters in place")
    if not p.is_contiguous():
        raise ValueError(f"{where} is not contiguous; call .contiguous() on it before building the optimizer")
    grad = p.grad
    if grad.is_sparse:
        raise ValueError(f"{where} has a sparse gradient; {name} takes dense gradients (CPUAdagrad and "
                         "torch.optim.SparseAdam take sparse ones; or give the embedding sparse=False)")
    if grad.layout != torch.strided:
        raise ValueError(f"{where} has a gradient of layout {grad.layout}; {name} takes dense (strided) gradients")
    if grad.dtype not in DTYPE_CODES or grad.device.type != "cpu" or not grad.is_contiguous():
        raise ValueError(f"{where} has a gradient that is {grad.dtype} on {grad.device}"
                         f"{'' if grad.is_contiguous() else ', not contiguous'}; gradients must be contiguous "
                         "CPU tensors of float32, float16 or bfloat16")
    if grad.shape != p.shape:
        raise ValueError(f"{where} has a gradient of shape {tuple(grad.shape)}")
    if p.dtype in HALF_DTYPES and grad.dtype != p.dtype:
        raise ValueError(f"{where} is {p.dtype} and its gradient {grad.dtype}; a 16-bit parameter needs a "
                         "gradient of its own dtype")


def state_tensor(state: dict, key: str, p: torch.Tensor, dtype: torch.dtype, initial: float = 0.0) -> torch.Tensor:
    """The state tensor ``key`` of ``p`` in ``dtype``: created on the first step, and converted
    back after a load (torch's load_state_dict casts state to the parameter's dtype)."""
    tensor = state.get(key)
    if tensor is None:
        tensor = torch.full_like(p, initial, dtype=dtype, memory_format=torch.contiguous_format)
    elif tensor.dtype != dtype or not tensor.is_contiguous() or tensor.device != p.device:
        tensor = tensor.to(device=p.device, dtype=dtype).contiguous()
    state[key] = tensor
    return tensor


def next_step(state: dict) -> float:
    """Advance the per-parameter step (a float32 scalar tensor, as torch.optim keeps it)."""
    step = state.get("step")
    if step is None:
        step = torch.tensor(0.0, dtype=torch.float32)
    elif not torch.is_tensor(step):
        step = torch.tensor(float(step), dtype=torch.float32)
    step += 1
    state["step"] = step
    return float(step)


def stream_seed(step: float, group_index: int) -> int:
    """The seed of the stochastic rounding of bf16 states: new each step, reproducible."""
    return (int(step) * 0x9E3779B1 + group_index * 0x85EBCA6B + 0x165667B1) & 0xFFFFFFFF


class Batches:
    """Tensors of one group that share the kernel's scalar arguments, as lists of pointers."""

    def __init__(self):
        self._batches: dict[tuple, dict[str, list]] = defaultdict(lambda: defaultdict(list))

    def add(self, key: tuple, **pointers: torch.Tensor | int) -> None:
        batch = self._batches[key]
        for name, value in pointers.items():
            batch[name].append(value if isinstance(value, int) else value.data_ptr())

    def run(self, call: Callable[[tuple, dict[str, list]], None]) -> None:
        for key, batch in self._batches.items():
            call(key, batch)


def state_dtype_of(group: dict, p: torch.Tensor | None = None) -> torch.dtype:
    """The dtype of ``p``'s optimizer states in ``group`` ("param": the parameter's own dtype)."""
    if group["state_dtype"] == "param":
        if p is None or p.dtype == torch.float32:
            return torch.float32
        if p.dtype == torch.float16:
            raise ValueError(f"parameter of shape {tuple(p.shape)} is torch.float16 and fp32_optimizer_states=False "
                             "asks for states of its dtype; float16 optimizer states are not supported (they "
                             "overflow): use fp32_optimizer_states=True or state_dtype=torch.bfloat16")
        return p.dtype
    return torch.bfloat16 if group["state_dtype"] == "bfloat16" else torch.float32


def batch_group(optimizer: torch.optim.Optimizer, name: str, group: dict, states: dict[str, float],
                params: list[torch.Tensor] | None = None) -> Batches:
    """Check every parameter of ``group`` that has a gradient (or those of ``params``), advance its
    step, make its state tensors (``states``: key -> initial value) and batch the pointers by
    (step, gradient dtype)."""
    dtype = state_dtype_of(group)
    if params is None:
        params = [p for p in group["params"] if p.grad is not None]
    for p in params:  # all checks first: bad input must leave every state as it was
        check_cpu_param(name, p)
    batches = Batches()
    for p in params:
        state = optimizer.state[p]
        step = next_step(state)
        tensors = {key: state_tensor(state, key, p, dtype, initial) for key, initial in states.items()}
        batches.add((step, DTYPE_CODES[p.grad.dtype]), params=p, grads=p.grad, sizes=p.numel(), **tensors)
    return batches


def keep_saved_state_dtypes(optimizer: torch.optim.Optimizer, state_dict: dict, names: Iterable[str]) -> None:
    """After torch's load_state_dict, which casts every floating-point state to its parameter's
    dtype (rounding the float32 states of a 16-bit parameter to 16 bits): put back the saved
    states ``names`` of 16-bit parameters in their own dtypes."""
    saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
    params = dict(zip(saved_ids, chain.from_iterable(g["params"] for g in optimizer.param_groups), strict=True))
    for key, saved in state_dict["state"].items():
        p = params.get(key)
        if p is None or p.dtype == torch.float32:
            continue
        for name in names:
            value = saved.get(name)
            if torch.is_tensor(value) and value.dtype != p.dtype:
                optimizer.state[p][name] = value.detach().to(device=p.device, copy=True)


def closure_loss(closure):
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def num_threads() -> int:
    return torch.get_num_threads()
