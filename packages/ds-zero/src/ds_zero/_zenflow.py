"""ZenFlow (DeepSpeed's importance-aware offloaded optimizer) as a part of `ZeroOptimizer`.

Each micro-step ``m`` (counted from 0; ``U`` = ``update_interval``, ``W`` = ``full_warm_up_rounds``, ``S`` =
the selection interval in micro-steps, 0 for "select once"):

* **selection** (``m == W``, and ``m % S == 0`` after): the averaged gradient of this micro-step picks, in each
  weight matrix, the ``topk_ratio`` most important columns (`_zenflow_select`); their optimizer states restart
  at zero (their step count does not), and the CPU master copy is reset to the model's parameters.
* **every micro-step** from ``W`` on: the selected columns (and every 1-D parameter whole) are stepped at once by
  a bf16 AdamW on the model's own parameters with this micro-step's averaged gradient. The averages are this
  part's own all-reduce of just those columns (the full gradient at a selection), divided by the world size
  first, in bf16, as DeepSpeed's reduction does.
* **update boundaries** (``(m + 1 - W) % U == 0``, the end of a selection interval, every micro-step during
  warm-up): ZeRO hands over the accumulated, clipped gradient of this rank's partition, and the CPU Adam
  steps the float32 master copy (bias correction at step ``m + 1``). With ``overlap_step`` it runs in a
  background thread while the next micro-steps compute, on one of two sets of moments (alternating per
  update window, as DeepSpeed's double buffers), and the model receives a snapshot of the master copy taken
  after the previous update (DeepSpeed's one-update lag; none during warm-up, none at the first update after
  it). Without ``overlap_step`` the model receives the new master copy at once. Either way the selected
  columns are then restored and stepped with this micro-step's gradient.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any

import torch

import ds_comm

from ._model import version
from ._zenflow_config import ZenFlowConfig
from ._zenflow_select import adamw_, pieces, select_columns

logger = logging.getLogger(__name__)


def check_zenflow(config: ZenFlowConfig, *, precision: str, compute_grad_norm: bool, overlap_comm: bool) -> None:
    """What ZenFlow needs of its section and the run, checked before the model is touched: DeepSpeed's refusals
    (ValueError) and what ds has not built (NotImplementedError). Where it runs (the stage, the CPU offload) is
    the policy's to refuse (`_policy.resolve`)."""
    if not compute_grad_norm:
        raise ValueError("zero_optimization.compute_grad_norm false cannot be used with zenflow (its CPU step "
                         "clips by the global norm; DeepSpeed refuses this too)")
    if config.offload and not overlap_comm:
        raise ValueError("zero_optimization.zenflow.offload true needs zero_optimization.overlap_comm true "
                         "(DeepSpeed refuses this too)")
    if config.update_interval == "auto":
        raise NotImplementedError("zero_optimization.zenflow.update_interval 'auto' is not implemented in ds-zero "
                                  f"{version()}: give a number of micro-steps (the example uses 4)")
    if precision != "bf16":
        raise NotImplementedError(f"zero_optimization.zenflow with {precision} training is not implemented in "
                                  f"ds-zero {version()}: enable bf16 (ZenFlow's selected columns are stepped in it)")


class ZenFlow:
    """ZenFlow's state for one `ZeroOptimizer` (see the module docstring). ``params``: the trainable
    parameters in ZeRO's order; ``group_of``: each one's option group (DeepSpeed lays each group out and
    partitions it on its own); ``group``: the data-parallel group. Call `before_backward` at the start of
    each backward, `after_backward` after it, `full_step` at an update boundary (instead of the CPU Adam) and `after_step` after it."""

    def __init__(self, config: ZenFlowConfig, params: list[torch.nn.Parameter], group_of: list[int],
                 group: Any, world_size: int, optimizer: torch.optim.Optimizer):
        self.config, self.group, self.world_size = config, group, world_size
        self.update_interval = int(config.update_interval)
        self.warm_up = config.full_warm_up_rounds
        self.select_interval = config.selection_interval()
        self.params, self.group_of = params, group_of
        self.parts: list[list[tuple[int, int]]] = [[] for _ in params]
        for g in sorted(set(group_of)):
            members = [i for i, h in enumerate(group_of) if h == g]
            for i, parts in zip(members, pieces([params[i].numel() for i in members], world_size), strict=True):
                self.parts[i] = parts
        self.micro_step = -1
        self._index = {id(p): i for i, p in enumerate(params)}
        self._options = self._selective_options(optimizer)
        self.columns: list[torch.Tensor | None] = [None] * len(params)  # selected columns of each matrix
        self.states: list[dict[str, torch.Tensor] | None] = [None] * len(params)  # the selective AdamW's
        self._captured: dict[int, torch.Tensor] = {}  # this backward's local gradients (what is averaged)
        self._selected_grads: list[torch.Tensor | None] = [None] * len(params)
        self._saved: list[torch.Tensor | None] = [None] * len(params)  # selected values before a full step
        # the CPU side (created at the first update): moments per window parity, the gradients it steps with,
        # the master copy's snapshot the model receives (DeepSpeed's stale_param)
        self._moments: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        self._grads: list[list[torch.Tensor]] = []
        self._snapshot: list[torch.Tensor] = []
        self._worker: threading.Thread | None = None
        self._error: BaseException | None = None
        self._established = False
        self._first_after_warm_up = True
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in params]

    # --------------------------------------------------------------------------- the schedule
    def is_selection(self, m: int) -> bool:
        return m >= self.warm_up and (m == self.warm_up or (self.select_interval != 0 and m % self.select_interval == 0))

    def is_update_boundary(self, m: int) -> bool:
        """Whether micro-step ``m``'s ``step()`` updates through the CPU optimizer."""
        if m + 1 < self.warm_up:
            return True
        return (m + 1 - self.warm_up) % self.update_interval == 0 or \
            (self.select_interval != 0 and (m + 1) % self.select_interval == 0)

    # --------------------------------------------------------------------------- backward
    def before_backward(self, micro_step: int, sync_master: Any) -> None:
        """Micro-step ``micro_step`` begins its backward. At a selection (after the first micro-step) the CPU
        master copy is reset to the model's parameters (``sync_master()``) and the selected columns' moments
        are zeroed."""
        self.micro_step = micro_step
        self._captured.clear()
        if self.is_selection(micro_step):
            if micro_step != 0:
                self._join()
                sync_master()
            for state in self.states:
                if state is not None:
                    state["exp_avg"].zero_()
                    state["exp_avg_sq"].zero_()

    def _on_gradient(self, param: torch.Tensor) -> None:
        if self.micro_step < self.warm_up or param.grad is None:
            return
        i = self._index[id(param)]
        grad = param.grad.detach()
        if self._whole(i):
            self._captured[i] = grad.clone()
        else:
            self._captured[i] = grad[:, self.columns[i]]

    def _whole(self, i: int) -> bool:
        """Whether parameter ``i``'s whole gradient is averaged this micro-step (a 1-D one, a matrix at a selection
        or with no columns chosen yet), else its selected columns only."""
        return self.params[i].dim() != 2 or self.columns[i] is None or self.is_selection(self.micro_step)

    def after_backward(self) -> None:
        """After the backward (ZeRO's reductions issued, so the collectives keep one order on every rank):
        average what was captured (divided first, in bf16, as DeepSpeed's reduction), select at a selection,
        and step the selected columns now (between boundaries) or keep their values (at one). Every rank
        averages every parameter's piece (zeros where this rank had no gradient) and a presence flag per
        parameter, so the collective matches and a parameter any rank trained is stepped on all."""
        if self.micro_step < self.warm_up:
            return
        shapes = [p.shape if self._whole(i) else (p.shape[0], self.columns[i].numel())
                  for i, p in enumerate(self.params)]
        pieces = [self._captured[i].reshape(-1) if i in self._captured else
                  torch.zeros(math.prod(shape), dtype=p.dtype, device=p.device)
                  for i, (p, shape) in enumerate(zip(self.params, shapes, strict=True))]
        present = torch.tensor([1.0 if i in self._captured else 0.0 for i in range(len(self.params))],
                               dtype=pieces[0].dtype, device=pieces[0].device)
        flat = torch.cat([*pieces, present * self.world_size]).div_(self.world_size)
        ds_comm.all_reduce(flat, group=self.group)
        trained = flat[-len(self.params):] > 0
        selection = self.is_selection(self.micro_step)
        boundary = self.is_update_boundary(self.micro_step)
        at = 0
        for i, shape in enumerate(shapes):
            p = self.params[i]
            grad = flat[at:at + math.prod(shape)].view(shape)
            at += grad.numel()
            if not trained[i]:
                continue
            if p.dim() == 2:
                if selection or self.columns[i] is None:
                    self.columns[i] = select_columns(grad, self.parts[i], self.config.topk_ratio)
                    grad = grad[:, self.columns[i]]
                self._selected_grads[i] = grad
                if boundary:
                    self._saved[i] = p.detach()[:, self.columns[i]].clone()
            else:
                self._selected_grads[i] = grad
                if boundary:
                    self._saved[i] = p.detach().clone()
        self._captured.clear()
        if not boundary:
            self._step_selected()

    def _step_selected(self) -> None:
        """The selective AdamW over every parameter with a selected gradient (restored first where saved)."""
        for i, grad in enumerate(self._selected_grads):
            if grad is None:
                continue
            p = self.params[i]
            with torch.no_grad():
                values = p.detach()[:, self.columns[i]] if p.dim() == 2 else p.detach()
                if self._saved[i] is not None:
                    values.copy_(self._saved[i])
                state = self.states[i]
                if state is None:
                    # the step count stays a host scalar, as torch's non-capturable AdamW keeps it
                    state = self.states[i] = {"step": torch.zeros((), dtype=torch.float32, device="cpu"),
                                              "exp_avg": torch.zeros_like(values, device=values.device),
                                              "exp_avg_sq": torch.zeros_like(values, device=values.device)}
                adamw_(values, grad, state["exp_avg"], state["exp_avg_sq"], state["step"], **self._options[i])
                if p.dim() == 2:
                    p.detach()[:, self.columns[i]] = values
            self._selected_grads[i] = self._saved[i] = None

    # --------------------------------------------------------------------------- the update boundary
    def full_step(self, optimizer: torch.optim.Optimizer, recipe: Any, masters: list[torch.Tensor],
                  grads: list[torch.Tensor], copies: list[torch.Tensor], grad_scale: float) -> bool:
        """The CPU side of an update boundary, given the master tensors ZeRO's optimizer was built over, their
        accumulated gradients (times ``grad_scale``: loss scale over the clipping coefficient) and the 16-bit
        tensors the model is refreshed from. Returns whether ``copies`` were written (upload them)."""
        if not self._moments:
            self._moments = [[(torch.zeros_like(t, device=t.device), torch.zeros_like(t, device=t.device))
                              for t in masters] for _ in range(2)]
            self._grads = [[torch.zeros_like(t, device=t.device) for t in masters] for _ in range(2)]
            self._snapshot = [t.detach().clone() for t in masters]
        m = self.micro_step
        warm = m < self.warm_up
        parity = m & 1 if warm else (m // self.update_interval) & 1
        if not self.config.overlap_step:  # DeepSpeed's sequential ZenFlow: one set of moments, no lag
            self._submit(optimizer, recipe, masters, grads, grad_scale, 0, m + 1)
            self._join()
            for copy, master in zip(copies, masters, strict=True):
                copy.copy_(master)
            return True
        if warm:
            self._submit(optimizer, recipe, masters, grads, grad_scale, parity, m + 1)
        wrote = False
        if self._established:
            if m + 1 > self.warm_up and self._first_after_warm_up:
                self._first_after_warm_up = False  # the first update after warm-up reaches the model one later
            else:
                self._join()
                for copy, snapshot in zip(copies, self._snapshot, strict=True):
                    copy.copy_(snapshot)
                wrote = True
        if not warm:
            self._submit(optimizer, recipe, masters, grads, grad_scale, parity, m + 1)
        return wrote

    def _submit(self, optimizer: torch.optim.Optimizer, recipe: Any, masters: list[torch.Tensor],
                grads: list[torch.Tensor], grad_scale: float, parity: int, step: int) -> None:
        import ds_ops

        self._join()
        own = self._grads[parity]
        for target, grad in zip(own, grads, strict=True):
            target.copy_(grad).mul_(1.0 / grad_scale)  # widened, then clipped in float32 (DeepSpeed's order)
        index = {id(t): i for i, t in enumerate(masters)}
        work = []
        for group in optimizer.param_groups:
            options = recipe.hyperparameters(group)
            for t in group["params"]:
                i = index[id(t)]
                work.append((i, options))
        moments = self._moments[parity]

        def update() -> None:
            try:
                for i, options in work:
                    ds_ops.adam_step(masters[i].detach(), own[i], moments[i][0], moments[i][1], step,
                                     check_finite=False, **options)
                    self._snapshot[i].copy_(masters[i].detach())
            except BaseException as e:  # re-raised on the training thread by _join
                self._error = e

        self._established = True
        if self.config.overlap_step:
            self._worker = threading.Thread(target=update, name="ds-zenflow-step", daemon=True)
            self._worker.start()
        else:
            update()

    def _join(self) -> None:
        if self._worker is not None:
            self._worker.join()
            self._worker = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"ZenFlow's CPU optimizer step failed: {error}") from error

    def after_step(self) -> None:
        """After an update boundary's step: the selected columns get their values from before it back and are
        stepped with this micro-step's gradient (DeepSpeed's selective step at the boundary)."""
        if self.micro_step >= self.warm_up:
            self._step_selected()

    def _selective_options(self, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
        """Each parameter's AdamW options for the selective step: its option group's (lr read now)."""
        groups = optimizer.param_groups
        options = []
        for g in self.group_of:
            group = groups[g] if g < len(groups) else groups[0]
            options.append({"lr": float(group["lr"]), "betas": tuple(float(b) for b in group["betas"]),
                            "eps": float(group["eps"]), "weight_decay": float(group["weight_decay"])})
        return options

    def refresh_options(self, optimizer: torch.optim.Optimizer) -> None:
        """Read the learning rate and the other options of each group again (at every ``step()``, as
        DeepSpeed syncs the selective optimizer's learning rate)."""
        self._options = self._selective_options(optimizer)

    def close(self) -> None:
        """Wait for a CPU step in flight and remove the gradient hooks."""
        try:
            self._join()
        finally:
            for handle in self.hooks:
                handle.remove()
            self.hooks = []


def master_from_model(host: Any, masters: list[torch.Tensor], copies: list[torch.Tensor]) -> None:
    """The CPU master copy reset to the model's (16-bit) parameters of this rank's partition: ``host`` (the
    `HostOffload`) copies them into ``copies``, which are widened into ``masters``."""
    host.download_params()
    with torch.no_grad():
        for master, copy in zip(masters, copies, strict=True):
            master.copy_(copy)
