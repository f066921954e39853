"""What ds-zero's 1-bit optimizers (`ds_zero.onebit`) share: each parameter group stepped as one flat tensor
(the parameters' own storage when they lie back to back, as ZeRO's buckets do), the process group and the
switch between full-precision and 1-bit averaging, the error feedback (each rank's own), where the
parameters lie in the flat tensor (ZeRO's padding kept at zero), and the state that checkpoints carry."""

from __future__ import annotations

import logging
from typing import Any, Protocol, runtime_checkable

import torch

import ds_comm

logger = logging.getLogger(__name__)

# DeepSpeed's communication backends for these optimizers; ds-zero sends through ds-comm's process group
# whatever the name says (the message is 1-bit either way), so every one is accepted.
COMM_BACKENDS = ("nccl", "mpi", "hccl", "compressed", "gloo")


@runtime_checkable
class CompressedOptimizer(Protocol):
    """What `ZeroOptimizer` and its checkpoint ask of a 1-bit optimizer (`ds_zero.onebit`): it decides per step
    whether ZeRO averages the gradients (DeepSpeed's enable_backward_allreduce), reduces over ZeRO's group
    itself, learns where the parameters lie in its flat tensors, and keeps per-rank error feedback that
    checkpoints carry."""

    def wants_averaged_gradients(self) -> bool: ...

    def bind(self, group: Any, *, caller_reduces: bool) -> None: ...

    def set_segments(self, index: int, segments: list[tuple[int, int]]) -> None: ...

    def rank_state(self) -> dict[str, torch.Tensor]: ...

    def rank_state_template(self) -> dict[str, torch.Tensor]: ...

    def load_rank_state(self, state: dict[str, torch.Tensor] | None) -> None: ...


def _positive_int(owner: str, name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}: {name} must be an integer >= {minimum}, got {value!r}")
    return value


def _adjacent(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One 1-D tensor over ``tensors`` when they lie back to back in one storage (ZeRO's buckets), else None."""
    first = tensors[0]
    at = first.storage_offset()
    for t in tensors:
        if not t.is_contiguous() or t.dtype != first.dtype or t.untyped_storage().data_ptr() != \
                first.untyped_storage().data_ptr() or t.storage_offset() != at:
            return None
        at += t.numel()
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(
        first.untyped_storage(), first.storage_offset(), (at - first.storage_offset(),))


class _Flat:
    """A group's parameters as one flat tensor: their flat storage when adjacent, else copies in and out."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.view = _adjacent([p.detach() for p in params])
        self._grad_buffer: torch.Tensor | None = None

    def grads(self) -> torch.Tensor:
        """The gradients, flat (a view when they are adjacent; missing ones count as zero)."""
        grads = [p.grad for p in self.params]
        if all(g is not None for g in grads):
            flat = _adjacent(grads)
            if flat is not None:
                return flat
        if self._grad_buffer is None:
            self._grad_buffer = torch.empty(self.numel, dtype=torch.float32, device=self.params[0].device)
        at = 0
        for p, g in zip(self.params, grads, strict=True):
            part = self._grad_buffer[at:at + p.numel()]
            part.copy_(g.reshape(-1)) if g is not None else part.zero_()
            at += p.numel()
        return self._grad_buffer

    def params_flat(self) -> torch.Tensor:
        if self.view is not None:
            return self.view
        return torch.cat([p.detach().reshape(-1).float() for p in self.params])

    def write_back(self, flat: torch.Tensor) -> None:
        if self.view is not None:
            return  # stepped in place
        at = 0
        for p in self.params:
            p.detach().copy_(flat[at:at + p.numel()].view_as(p))
            at += p.numel()


class _CompressedAdam(torch.optim.Optimizer):
    """What 1-bit Adam and 0/1 Adam share: flat state per group, the process group, the switch between
    full-precision and compressed communication, and the error-feedback buffers."""

    FLAT_STATES: tuple[str, ...] = ("exp_avg", "exp_avg_sq")

    def __init__(self, params: Any, *, lr: float, bias_correction: bool, betas: Any, eps: float, weight_decay: float,
                 max_grad_norm: float, amsgrad: bool, cuda_aware: bool, comm_backend_name: str, group: Any,
                 eps_inside_sqrt: bool = False):
        owner = type(self).__name__
        if amsgrad:
            raise ValueError(f"{owner}: amsgrad is not supported (as in the reference)")
        if eps_inside_sqrt:
            raise ValueError(f"{owner}: eps_inside_sqrt is not supported; eps is added after the square root")
        if max_grad_norm:
            raise ValueError(f"{owner}: max_grad_norm is not an optimizer parameter here; use the config's "
                             "'gradient_clipping' (ZeroOptimizer's gradient_clipping)")
        if comm_backend_name not in COMM_BACKENDS:
            raise ValueError(f"{owner}: comm_backend_name must be one of {', '.join(COMM_BACKENDS)}, got "
                             f"{comm_backend_name!r} (ds-zero sends through ds-comm's process group whatever the name)")
        if not (isinstance(lr, (int, float)) and lr >= 0):
            raise ValueError(f"{owner}: lr must be a number >= 0, got {lr!r}")
        beta1, beta2 = betas
        if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
            raise ValueError(f"{owner}: betas must be two numbers in [0, 1), got {tuple(betas)!r}")
        if not eps > 0:
            raise ValueError(f"{owner}: eps must be > 0, got {eps!r}")
        defaults = {"lr": lr, "bias_correction": bias_correction, "betas": (beta1, beta2), "eps": eps,
                    "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.cuda_aware, self.comm_backend_name = cuda_aware, comm_backend_name
        self.bind(group, caller_reduces=False)
        self._flat: list[_Flat] = []
        self._buffers: list[dict[str, torch.Tensor]] = []  # per group: flat states and error feedback
        for group_ in self.param_groups:
            params_ = [p for p in group_["params"]]
            for p in params_:
                if p.dtype != torch.float32:
                    raise ValueError(f"{owner}: parameters must be float32 (a 16-bit model steps its float32 "
                                     f"master copy under ZeroOptimizer), got {p.dtype}")
            flat = _Flat(params_) if params_ else None
            self._flat.append(flat)
            buffers: dict[str, torch.Tensor] = {}
            if flat is not None:
                device = params_[0].device
                for key in self.FLAT_STATES:
                    buffers[key] = torch.zeros(flat.numel, dtype=torch.float32, device=device)
                at = 0
                for p in params_:  # per-parameter views: what torch's state_dict and ds-zero's checkpoint see
                    self.state[p].update({key: buffers[key][at:at + p.numel()].view_as(p)
                                          for key in self.FLAT_STATES})
                    at += p.numel()
            self._buffers.append(buffers)
        self._errors: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.param_groups)
        # per group: (start, length) of each parameter in the flat tensor; what lies between them (ZeRO's
        # padding) is kept at zero. Standalone, the parameters themselves, back to back.
        self._segments: list[list[tuple[int, int]]] = []
        self._gaps: list[list[tuple[int, int]]] = []
        for group_ in self.param_groups:
            at, segments = 0, []
            for p in group_["params"]:
                segments.append((at, p.numel()))
                at += p.numel()
            self._segments.append(segments)
            self._gaps.append([])
        for group_ in self.param_groups:  # the counters live in the groups: every checkpoint keeps them
            for key, value in self.COUNTERS.items():
                group_.setdefault(key, value)
        self.compressed_calls = 0  # compressed all-reduces sent (one per group and call)

    COUNTERS: dict[str, Any] = {"onebit_step": 0}

    def _counter(self, key: str) -> Any:
        return self.param_groups[0][key]

    def _set_counter(self, key: str, value: Any) -> None:
        for group in self.param_groups:
            group[key] = value

    @property
    def steps(self) -> int:
        """Optimizer steps taken."""
        return int(self._counter("onebit_step"))

    # ------------------------------------------------------------------------------------- protocol
    def bind(self, group: Any, *, caller_reduces: bool) -> None:
        """The data-parallel process group, and whether the caller (ZeroOptimizer) averages the gradients
        on the steps `wants_averaged_gradients` asks for (else this optimizer does, before stepping)."""
        self.group, self.caller_reduces = group, caller_reduces

    @property
    def world_size(self) -> int:
        if not ds_comm.is_initialized():
            raise RuntimeError(f"{type(self).__name__}: the process group is not initialised; call "
                               "ds_comm.init_distributed() first")
        return ds_comm.get_world_size(self.group)

    def wants_averaged_gradients(self) -> bool:
        """Whether the next step needs the gradients averaged in full precision (else local ones)."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------- helpers
    def _grads(self, index: int, averaged: bool) -> torch.Tensor:
        """Group ``index``'s gradients, flat; averaged here when they must be and the caller did not."""
        grad = self._flat[index].grads()
        if averaged and not self.caller_reduces and self.world_size > 1:
            ds_comm.all_reduce(grad, group=self.group)
            grad.div_(self.world_size)
        return grad

    def _compressed_average(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (flat, float32) averaged over the ranks by the 1-bit all-reduce, in place."""
        if self.world_size == 1:
            return tensor
        if self._errors[index] is None:
            self._errors[index] = tuple(torch.zeros(size, device=tensor.device)
                                        for size in ds_comm.error_buffer_sizes(tensor.numel(), self.world_size))
        worker, server = self._errors[index]
        self.compressed_calls += 1
        ds_comm.compressed_allreduce(tensor, worker, server, group=self.group)
        for start, length in self._gaps[index]:  # 1 bit cannot say 0: what must stay zero is reset
            tensor[start:start + length].zero_()
        return tensor

    def set_segments(self, index: int, segments: list[tuple[int, int]]) -> None:
        """Where group ``index``'s parameters lie in its flat tensor ((start, length), ascending): ZeRO's
        buckets are padded, and the padding must stay zero (compressed, it would not: DeepSpeed's
        ``exp_avg_mask``); LAMB's trust ratios are taken per parameter."""
        flat = self._flat[index]
        numel = 0 if flat is None else flat.numel
        at, gaps = 0, []
        for start, length in segments:
            if start < at or length < 1 or start + length > numel:
                raise ValueError(f"{type(self).__name__}.set_segments: segments must be ascending, disjoint and "
                                 f"inside group {index}'s {numel} elements; got ({start}, {length}) after {at}")
            if start > at:
                gaps.append((at, start - at))
            at = start + length
        if at < numel:
            gaps.append((at, numel - at))
        self._segments[index], self._gaps[index] = list(segments), gaps

    def _reset_errors(self) -> None:
        for pair in self._errors:
            if pair is not None:
                pair[0].zero_()
                pair[1].zero_()

    def _adam_update(self, index: int, group: dict[str, Any], params: torch.Tensor) -> torch.Tensor:
        """``params -= lr * update`` with ``update = m / (sqrt(v) + eps) + weight_decay * params``; returns
        the update."""
        buffers = self._buffers[index]
        update = buffers["exp_avg_sq"].sqrt().add_(group["eps"])
        torch.div(buffers["exp_avg"], update, out=update)
        if group["weight_decay"]:
            update.add_(params, alpha=group["weight_decay"])
        params.add_(update, alpha=-group["lr"])
        return update

    def _count_step(self) -> None:
        self._set_counter("onebit_step", self.steps + 1)

    # ------------------------------------------------------------------------------------- state
    def rank_state(self) -> dict[str, torch.Tensor]:
        """This rank's own tensors (the error feedback of each group that has sent compressed), by name: the
        worker and server error states of `ds_comm.compressed_allreduce`, as it keeps them (the values last
        compressed, then their scales; the error is each value minus ±its scale), restored as they are."""
        out = {}
        for index, pair in enumerate(self._errors):
            if pair is not None:
                out[f"{index}/worker_error"], out[f"{index}/server_error"] = pair
        return out

    def rank_state_template(self) -> dict[str, torch.Tensor]:
        """Zero tensors of `rank_state`'s names and sizes for every group (what a load reads into)."""
        out = {}
        for index, flat in enumerate(self._flat):
            if flat is not None:
                worker, server = ds_comm.error_buffer_sizes(flat.numel, self.world_size)
                device = flat.params[0].device
                out[f"{index}/worker_error"] = torch.zeros(worker, device=device)
                out[f"{index}/server_error"] = torch.zeros(server, device=device)
        return out

    def load_rank_state(self, state: dict[str, torch.Tensor] | None) -> None:
        """This rank's error feedback from `rank_state` (None: restart it at zero)."""
        errors: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.param_groups)
        for index, flat in enumerate(self._flat):
            if state is not None and f"{index}/worker_error" in state:
                pair = (state[f"{index}/worker_error"], state[f"{index}/server_error"])
                sizes = ds_comm.error_buffer_sizes(0 if flat is None else flat.numel, self.world_size)
                if tuple(t.numel() for t in pair) != sizes:
                    raise ValueError(f"{type(self).__name__}.load_rank_state: group {index}'s error feedback has "
                                     f"{pair[0].numel()} + {pair[1].numel()} elements, this optimizer's needs "
                                     f"{sizes[0]} + {sizes[1]} (ds_comm.error_buffer_sizes): saved for other "
                                     "parameters, another world size, or by a ds-zero whose buffers held the "
                                     "errors themselves")
                device = flat.params[0].device if flat is not None else pair[0].device  # a host copy comes back
                errors[index] = (pair[0].to(device, copy=True), pair[1].to(device, copy=True))
        self._errors = errors

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["ds_onebit"] = {"rank_state": self.rank_state(), "world_size": self.world_size}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        extra = state_dict.get("ds_onebit")
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "ds_onebit"})
        self._adopt_loaded_states()
        if extra is not None and extra["world_size"] == self.world_size:
            self.load_rank_state(extra["rank_state"])
        else:
            self.load_rank_state(None)
            if extra is not None:
                logger.warning("%s: state saved on %d ranks, loaded on %d: the error feedback restarts at zero",
                               type(self).__name__, extra["world_size"], self.world_size)

    def _adopt_loaded_states(self) -> None:
        """torch's load_state_dict replaces the state tensors: copy them into the flat buffers and make the
        views the state again."""
        for index, group in enumerate(self.param_groups):
            at = 0
            for p in group["params"]:
                for key in self.FLAT_STATES:
                    view = self._buffers[index][key][at:at + p.numel()].view_as(p)
                    loaded = self.state[p].get(key)
                    if loaded is not None and loaded.data_ptr() != view.data_ptr():
                        view.copy_(loaded)
                    self.state[p][key] = view
                at += p.numel()
