"""Communication-efficient optimizers: 1-bit Adam (Tang et al. 2021), 0/1 Adam (Lu et al. 2022) and
1-bit LAMB (Li et al. 2021, `OneBitLamb`, described in its class).

1-bit Adam and 0/1 Adam start as Adam on gradients averaged in full precision, then stop sending
full-precision data:

* `OneBitAdam`: ``freeze_step`` warm-up steps of Adam (no bias correction, as the reference); then the
  variance is frozen and each rank updates the momentum with its *local* gradient, and the momentum is
  averaged by ds-comm's 1-bit compressed all-reduce with error feedback (`ds_comm.compressed_allreduce`:
  ~1/32 of the bytes). The update is ``m / (sqrt(v) + eps) (+ weight_decay * p)``.
* `ZeroOneAdam`: the variance is updated only on steps ``t`` with ``t % var_interval == 0`` (from the
  gradient averaged in full precision); ``var_interval`` doubles every ``var_update_scaler`` such
  steps, and no variance step comes after ``var_freeze_step``. On the other steps the gradient itself
  is averaged by the 1-bit all-reduce. After ``var_freeze_step`` the ranks take *local steps* (nothing
  sent): each applies its own update, their sum ``u`` growing; every ``local_step_interval`` steps they
  go back to where they last agreed, average ``u`` (scaled by ``sqrt(v) + eps``) with the 1-bit
  all-reduce, apply the average and set the momentum from it. ``local_step_interval`` doubles every
  ``local_step_scaler`` steps, up to ``local_step_clipper``.

Each parameter group is stepped as one flat tensor (its momentum, variance and error feedback are flat
buffers; the per-parameter ``exp_avg``/``exp_avg_sq`` in ``state`` are views of them), so a step sends
one compressed message per group, not one per parameter. Under `ds_zero.ZeroOptimizer` (stage 0) the
parameters are ZeRO's flat buckets already and nothing is copied; ZeroOptimizer then reduces the
gradients in full precision, overlapped with backward, exactly on the steps `wants_averaged_gradients`
asks for (DeepSpeed's ``enable_backward_allreduce`` switch), and leaves them local otherwise. Used
alone, the optimizer averages the gradients itself when it needs them averaged:

    optimizer = ds_zero.OneBitAdam(model.parameters(), lr=1e-3, freeze_step=100)
    loss.backward()          # local gradients: no DDP
    optimizer.step()         # averages (warm-up) or compresses (after) over the process group

The error-feedback buffers are each rank's own: `state_dict` holds them (and ds-zero's checkpoints save
them per rank); loaded on another world size they restart at zero, as the reference always does. They are
ds-comm's error states as `ds_comm.compressed_allreduce` keeps them (the values last compressed, then their
chunks' scales; the error is each value minus ±its scale), saved and restored as they are; a saved state
of another size (other parameters, or one holding the errors themselves) is refused.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from ._compressed import _CompressedAdam, _positive_int

logger = logging.getLogger(__name__)


class OneBitAdam(_CompressedAdam):
    """1-bit Adam (see the module docstring). DeepSpeed's arguments: ``freeze_step`` (warm-up steps of
    full-precision Adam, >= 1), ``cuda_aware`` and ``comm_backend_name`` (accepted; the messages go
    through ds-comm), ``bias_correction`` (accepted and unused, as in the reference); ``group``: the
    data-parallel process group (default: all ranks)."""


    def __init__(self, params: Any, lr: float = 1e-3, freeze_step: int = 100000, bias_correction: bool = True,
                 betas: Any = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, amsgrad: bool = False, cuda_aware: bool = False,
                 comm_backend_name: str = "nccl", group: Any = None):
        self.freeze_step = _positive_int("OneBitAdam", "freeze_step", freeze_step)
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, max_grad_norm=max_grad_norm, amsgrad=amsgrad,
                         cuda_aware=cuda_aware, comm_backend_name=comm_backend_name, group=group,
                         eps_inside_sqrt=eps_inside_sqrt)

    @property
    def frozen(self) -> bool:
        """Whether the variance is frozen and the momentum travels compressed (after ``freeze_step`` steps)."""
        return self.steps >= self.freeze_step

    def wants_averaged_gradients(self) -> bool:
        return not self.frozen

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        frozen = self.frozen
        for index, group in enumerate(self.param_groups):
            if self._flat[index] is None:
                continue
            beta1, beta2 = group["betas"]
            grad = self._grads(index, averaged=not frozen)
            m, v = self._buffers[index]["exp_avg"], self._buffers[index]["exp_avg_sq"]
            m.mul_(beta1).add_(grad, alpha=1 - beta1)
            if frozen:
                self._compressed_average(index, m)
            else:
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            params = self._flat[index].params_flat()
            self._adam_update(index, group, params)
            self._flat[index].write_back(params)
        self._count_step()
        if self.steps == self.freeze_step:
            logger.info("OneBitAdam: %d warm-up steps done; the momentum travels 1-bit compressed from now on",
                        self.steps)
        return loss


class ZeroOneAdam(_CompressedAdam):
    """0/1 Adam (see the module docstring). DeepSpeed's arguments: ``var_freeze_step`` (the last step
    that may update the variance), ``var_update_scaler`` (variance steps at one interval before it
    doubles), ``local_step_scaler`` (steps at one local-step interval before it doubles),
    ``local_step_clipper`` (the largest local-step interval); ``cuda_aware``, ``comm_backend_name`` and
    ``bias_correction`` accepted (see `OneBitAdam`); ``group``: the data-parallel process group."""

    # sync_params: the parameters at the last synchronisation (every rank's the same, bit for bit); the
    # paper's accumulator u of the local updates is the parameters minus them, taken when it is sent, so
    # that after a synchronisation the ranks hold identical parameters, not ones a rounding apart
    FLAT_STATES = ("exp_avg", "exp_avg_sq", "sync_params")

    def __init__(self, params: Any, lr: float = 1e-3, bias_correction: bool = True, betas: Any = (0.9, 0.999),
                 eps: float = 1e-8, eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, var_freeze_step: int = 100000, var_update_scaler: int = 16,
                 local_step_scaler: int = 32678, local_step_clipper: int = 16, amsgrad: bool = False,
                 cuda_aware: bool = False, comm_backend_name: str = "nccl", group: Any = None):
        self.var_freeze_step = _positive_int("ZeroOneAdam", "var_freeze_step", var_freeze_step)
        self.var_update_scaler = _positive_int("ZeroOneAdam", "var_update_scaler", var_update_scaler)
        self.local_step_scaler = _positive_int("ZeroOneAdam", "local_step_scaler", local_step_scaler)
        self.local_step_clipper = _positive_int("ZeroOneAdam", "local_step_clipper", local_step_clipper)
        self.local_steps_skipped = 0  # steps that sent nothing
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, max_grad_norm=max_grad_norm, amsgrad=amsgrad,
                         cuda_aware=cuda_aware, comm_backend_name=comm_backend_name, group=group,
                         eps_inside_sqrt=eps_inside_sqrt)

    @property
    def frozen(self) -> bool:
        """Whether the variance is frozen and the ranks take local steps (after ``var_freeze_step``)."""
        return self.steps >= self.var_freeze_step

    def wants_averaged_gradients(self) -> bool:
        return not self.frozen and (self.steps + 1) % self.var_interval == 0

    # var_interval doubles every var_update_scaler variance steps; local_step_interval every
    # local_step_scaler local steps; lrs (per group): the learning rates of the local steps since the
    # last synchronisation
    COUNTERS = {"onebit_step": 0, "var_interval": 1, "var_counter": 0, "local_step_interval": 1,
                "local_step_counter": 0, "lrs": 0.0}

    @property
    def var_interval(self) -> int:
        return int(self._counter("var_interval"))

    @property
    def local_step_interval(self) -> int:
        return int(self._counter("local_step_interval"))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        t = self.steps + 1
        if not self.frozen:
            variance_step = t % self.var_interval == 0
            for index, group in enumerate(self.param_groups):
                if self._flat[index] is None:
                    continue
                beta1, beta2 = group["betas"]
                grad = self._grads(index, averaged=variance_step)
                m, v = self._buffers[index]["exp_avg"], self._buffers[index]["exp_avg_sq"]
                if variance_step:
                    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                else:
                    grad = self._compressed_average(index, grad)
                m.mul_(beta1).add_(grad, alpha=1 - beta1)
                params = self._flat[index].params_flat()
                self._adam_update(index, group, params)
                self._flat[index].write_back(params)
            if variance_step:
                counter = int(self._counter("var_counter")) + 1
                if counter == self.var_update_scaler:
                    counter = 0
                    self._set_counter("var_interval", self.var_interval * 2)
                self._set_counter("var_counter", counter)
            self._count_step()
            if self.frozen:  # the errors now compress another quantity (the accumulated updates)
                self._reset_errors()
                for index, flat in enumerate(self._flat):
                    if flat is not None:
                        self._buffers[index]["sync_params"].copy_(flat.params_flat())
                logger.info("ZeroOneAdam: variance frozen after %d steps; local steps from now on", self.steps)
            return loss
        synchronise = t % self.local_step_interval == 0
        for index, group in enumerate(self.param_groups):
            if self._flat[index] is None:
                continue
            beta1 = group["betas"][0]
            grad = self._grads(index, averaged=False)
            m, v, anchor = (self._buffers[index][k] for k in ("exp_avg", "exp_avg_sq", "sync_params"))
            m.mul_(beta1).add_(grad, alpha=1 - beta1)
            params = self._flat[index].params_flat()
            self._adam_update(index, group, params)
            group["lrs"] = float(group["lrs"]) + group["lr"]
            if synchronise:
                denominator = v.sqrt().add_(group["eps"])
                u = torch.sub(params, anchor).mul_(denominator)  # the local updates, in momentum units
                self._compressed_average(index, u)
                m.copy_(u).div_(-group["lrs"])
                params.copy_(anchor).addcdiv_(u, denominator)  # from where the ranks agreed
                anchor.copy_(params)
                group["lrs"] = 0.0
            self._flat[index].write_back(params)
        if not synchronise:
            self.local_steps_skipped += 1
        counter = int(self._counter("local_step_counter")) + 1
        if counter == self.local_step_scaler:
            counter = 0
            self._set_counter("local_step_interval", min(self.local_step_clipper, self.local_step_interval * 2))
        self._set_counter("local_step_counter", counter)
        self._count_step()
        return loss



class OneBitLamb(_CompressedAdam):
    """1-bit LAMB (Li et al. 2021). Warm-up: LAMB on the gradients averaged in full precision (no bias
    correction, as the reference): each parameter's update ``m / (sqrt(v) + eps) + weight_decay * p`` is
    scaled by its trust ratio ``||p|| / ||update||`` clamped to ``[min_coeff, max_coeff]``, whose running
    average (``coeff_beta``) is kept. From ``freeze_step`` on, the momentum is updated locally, scaled per
    parameter to a common magnitude (the mean RMS of the momenta at the end of warm-up over each one's
    own) so that one 1-bit message compresses them all fairly, averaged by the 1-bit all-reduce, scaled
    back; the variance is frozen and a fresh one is kept from the gradients reconstructed from the
    averaged momentum; the trust ratio is the frozen average times a factor ``max(frozen denominator /
    fresh denominator)``, clamped to ``[factor_min, factor_max]`` and to within ``factor_threshold`` of
    the last step's. DeepSpeed's arguments; ``group``: the data-parallel process group."""

    FLAT_STATES = ("exp_avg", "exp_avg_sq", "exp_avg_sq_fresh")

    def __init__(self, params: Any, lr: float = 1e-3, freeze_step: int = 100000, bias_correction: bool = True,
                 betas: Any = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, max_coeff: float = 10.0, min_coeff: float = 0.01, amsgrad: bool = False,
                 cuda_aware: bool = False, comm_backend_name: str = "nccl", coeff_beta: float = 0.9,
                 factor_max: float = 4.0, factor_min: float = 0.5, factor_threshold: float = 0.1, group: Any = None):
        self.freeze_step = _positive_int("OneBitLamb", "freeze_step", freeze_step)
        for name, value in (("max_coeff", max_coeff), ("min_coeff", min_coeff), ("factor_max", factor_max),
                            ("factor_min", factor_min)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"OneBitLamb: {name} must be a number > 0, got {value!r}")
        if min_coeff > max_coeff or factor_min > factor_max:
            raise ValueError(f"OneBitLamb: need min_coeff <= max_coeff and factor_min <= factor_max, got "
                             f"[{min_coeff}, {max_coeff}] and [{factor_min}, {factor_max}]")
        if not 0 <= coeff_beta < 1 or not factor_threshold >= 0:
            raise ValueError(f"OneBitLamb: coeff_beta must be in [0, 1) and factor_threshold >= 0, got {coeff_beta!r} "
                             f"and {factor_threshold!r}")
        self.coeff_beta, self.factor_threshold = coeff_beta, factor_threshold
        self.factor_max, self.factor_min = factor_max, factor_min
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, max_grad_norm=max_grad_norm, amsgrad=amsgrad,
                         cuda_aware=cuda_aware, comm_backend_name=comm_backend_name, group=group,
                         eps_inside_sqrt=eps_inside_sqrt)
        for group_ in self.param_groups:
            group_.setdefault("max_coeff", max_coeff)
            group_.setdefault("min_coeff", min_coeff)
        self.lamb_coeffs: list[float] = []  # the last step's trust ratios, parameter by parameter (as DeepSpeed's)

    # per group, one value per parameter (lists: kept by every checkpoint as the groups' plain data):
    # lamb_coeff_freeze (the running average of the warm-up trust ratios), last_factor (the last
    # compressed step's factor) and scaling_coeff (the momentum scaling of the compression stage, empty
    # until it starts)

    @property
    def frozen(self) -> bool:
        """Whether the compression stage has begun (after ``freeze_step`` warm-up steps)."""
        return self.steps >= self.freeze_step

    def wants_averaged_gradients(self) -> bool:
        return not self.frozen

    def set_segments(self, index: int, segments: list[tuple[int, int]]) -> None:
        super().set_segments(index, segments)
        self._per_parameter(index, reset=True)

    def _per_parameter(self, index: int, reset: bool = False) -> None:
        group, count = self.param_groups[index], len(self._segments[index])
        if reset or len(group.get("lamb_coeff_freeze", ())) != count:
            group["lamb_coeff_freeze"], group["last_factor"], group["scaling_coeff"] = [0.0] * count, [1.0] * count, []

    def _views(self, index: int, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[start:start + length] for start, length in self._segments[index]]

    @staticmethod
    def _norms(views: list[torch.Tensor]) -> list[float]:
        return [float(n) for n in torch._foreach_norm(views)] if views else []

    def _start_compression(self) -> None:
        """Each parameter's momentum scaled to the mean RMS of all of them (the reference's united scale)."""
        rms = []
        for index in range(len(self.param_groups)):
            if self._flat[index] is not None:
                views = self._views(index, self._buffers[index]["exp_avg"])
                rms.append([norm / math.sqrt(v.numel()) for norm, v in zip(self._norms(views), views, strict=True)])
        flat = [r for group_rms in rms for r in group_rms]
        united = sum(flat) / len(flat) if flat else 1.0
        groups = [g for index, g in enumerate(self.param_groups) if self._flat[index] is not None]
        for group, group_rms in zip(groups, rms, strict=True):
            group["scaling_coeff"] = [united / r if r > 0 else 1.0 for r in group_rms]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        frozen = self.frozen
        for index, group in enumerate(self.param_groups):
            if group["params"]:
                self._per_parameter(index)
        if frozen and any(not g["scaling_coeff"] for g in self.param_groups if g["params"]):
            self._start_compression()
        self.lamb_coeffs = []
        for index, group in enumerate(self.param_groups):
            if self._flat[index] is None:
                continue
            params = self._flat[index].params_flat()
            grad = self._grads(index, averaged=not frozen)
            if frozen:
                coeffs, update = self._compressed_step(index, group, grad, params)
            else:
                coeffs, update = self._warm_up_step(index, group, grad, params)
            self.lamb_coeffs += coeffs
            torch._foreach_mul_(self._views(index, update), [-group["lr"] * c for c in coeffs])
            params.add_(update)
            self._flat[index].write_back(params)
        self._count_step()
        return loss

    def _warm_up_step(self, index: int, group: dict[str, Any], grad: torch.Tensor, params: torch.Tensor
                      ) -> tuple[list[float], torch.Tensor]:
        beta1, beta2 = group["betas"]
        m, v, fresh = (self._buffers[index][k] for k in self.FLAT_STATES)
        m.mul_(beta1).add_(grad, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        if self.steps + 1 == self.freeze_step:
            fresh.copy_(v)
        update = v.sqrt().add_(group["eps"])
        torch.div(m, update, out=update)
        if group["weight_decay"]:
            update.add_(params, alpha=group["weight_decay"])
        coeffs = []
        averaged = group["lamb_coeff_freeze"]
        for i, (w, u) in enumerate(zip(self._norms(self._views(index, params)), self._norms(self._views(index, update)),
                                       strict=True)):
            coeff = min(max(w / u, group["min_coeff"]), group["max_coeff"]) if w != 0 and u != 0 else 1.0
            if coeff != 1.0:
                averaged[i] = self.coeff_beta * averaged[i] + (1 - self.coeff_beta) * coeff
            coeffs.append(coeff)
        return coeffs, update

    def _compressed_step(self, index: int, group: dict[str, Any], grad: torch.Tensor, params: torch.Tensor
                         ) -> tuple[list[float], torch.Tensor]:
        beta1, beta2 = group["betas"]
        m, v, fresh = (self._buffers[index][k] for k in self.FLAT_STATES)
        last = m.clone()
        m.mul_(beta1).add_(grad, alpha=1 - beta1)
        scaling = group["scaling_coeff"]
        torch._foreach_mul_(self._views(index, m), scaling)
        self._compressed_average(index, m)
        torch._foreach_mul_(self._views(index, m), [1.0 / s for s in scaling])
        reconstructed = last.mul_(-beta1).add_(m).div_(1 - beta1)  # the gradient the averaged momentum implies
        fresh.mul_(beta2).addcmul_(reconstructed, reconstructed, value=1 - beta2)
        denominator = v.sqrt().add_(group["eps"])
        ratio = fresh.sqrt().add_(group["eps"])
        torch.div(denominator, ratio, out=ratio)
        prelim = torch.div(m, denominator, out=denominator)
        update = prelim.clone()
        if group["weight_decay"]:
            update.add_(params, alpha=group["weight_decay"])
        factors = [float(view.max()) for view in self._views(index, ratio)]
        if group["weight_decay"]:
            shares = [min(1.0, p / u) if u > 0 else 1.0 for p, u in zip(
                self._norms(self._views(index, prelim)), self._norms(self._views(index, update)), strict=True)]
            factors = [f * s + (1.0 - s) for f, s in zip(factors, shares, strict=True)]
        coeffs, last_factors = [], group["last_factor"]
        for i, factor in enumerate(factors):
            factor = min(max(factor, self.factor_min), self.factor_max)
            factor = min(max(factor, last_factors[i] * (1.0 - self.factor_threshold)),
                         last_factors[i] * (1.0 + self.factor_threshold))
            last_factors[i] = factor
            coeffs.append(group["lamb_coeff_freeze"][i] * factor)
        return coeffs, update
