"""The device path of ``adam_step`` and FusedAdam: torch's fused multi-tensor Adam kernels
(``torch._fused_adam_`` / ``torch._fused_adamw_``, what ``torch.optim.AdamW(fused=True)`` runs),
computing in float32; plus the same step without bias correction in ``torch._foreach_*`` ops
(torch's fused kernel always corrects).

Nothing here is CUDA-specific: the same calls run on CPU tensors (torch has a CPU fused Adam), which
is how CPU CI tests this path. What the kernels cannot take directly is staged through float32
scratch buffers of at most `CHUNK` elements on the tensors' device: 16-bit gradients (widened),
float32 gradients when ``grad_scale != 1`` (torch's kernel writes the unscaled gradients back, and
the caller's gradients must stay as they are), and 16-bit parameters and bfloat16 states next to
float32 ones (updated in float32, stored back rounded to nearest).
"""

from __future__ import annotations

import torch

CHUNK = 1 << 26  # elements of float32 scratch per batch: 256 MiB at most for each staged role


def found_non_finite(grads: list[torch.Tensor], grad_scale: float) -> bool:
    """True when some ``grad / grad_scale`` is inf or nan: one read-only multi-tensor pass (the
    largest magnitude of each tensor; nan propagates through it) and one host synchronisation."""
    grads = [g for g in grads if g.numel()]
    if not grads:
        return False
    largest = torch.stack([n.float() for n in torch._foreach_norm(grads, float("inf"))]).max()
    return not bool(torch.isfinite(largest / grad_scale))


def step_tensor(step: float, device: torch.device) -> torch.Tensor:
    """A step count as torch's fused kernels read it: a float32 scalar on the parameters' device."""
    return torch.full((), float(step), dtype=torch.float32, device=device)


def update(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avg: list[torch.Tensor],
           exp_avg_sq: list[torch.Tensor], copies: list[torch.Tensor | None], steps: list[torch.Tensor], *,
           lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, adamw: bool,
           bias_correction: bool, grad_scale: float) -> None:
    """One Adam/AdamW step, inputs already checked: contiguous tensors on one device, one dtype per
    role; params float32 or 16-bit, grads any float dtype (16-bit parameters: their own),
    ``exp_avg``/``exp_avg_sq`` float32 or bfloat16 (rounded to nearest: no stochastic rounding
    here); ``copies``: None or 16-bit tensors receiving the new parameters; ``steps``: each
    tensor's step number (float32 scalars on the device)."""
    device = params[0].device
    hyper = {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay, "adamw": adamw}
    if bias_correction and grad_scale == 1.0 and params[0].dtype == grads[0].dtype == exp_avg[0].dtype:
        # one dtype end to end (float32, or all bfloat16 as torch.optim.AdamW(fused=True) on a bf16
        # model): torch's kernel computes in float32 and stores each role in its own dtype
        _fused(params, grads, exp_avg, exp_avg_sq, steps, None, **hyper)
        _copy_out(copies, params)
        return
    # staged roles: 16-bit parameters and states; gradients when 16-bit, when scaled (torch's kernel
    # writes the unscaled values back) or for the foreach step (which overwrites them)
    staged = (params[0].dtype != torch.float32,
              grads[0].dtype != torch.float32 or grad_scale != 1.0 or not bias_correction,
              exp_avg[0].dtype != torch.float32, exp_avg[0].dtype != torch.float32)
    flat = [[t.view(-1) for t in role] for role in (params, grads, exp_avg, exp_avg_sq)]
    flat_copies = [None if c is None else c.view(-1) for c in copies]
    room = min(CHUNK, sum(p.numel() for p in params))
    scratch = [torch.empty(room, dtype=torch.float32, device=device) if s else None for s in staged]
    scale = torch.full((), grad_scale, dtype=torch.float32, device=device) if grad_scale != 1.0 else None
    for batch in _batches([p.numel() for p in params], room):
        pieces = [[role[i][a:b] for i, a, b in batch] for role in flat]
        wide = [pieces[r] if scratch[r] is None else _views(scratch[r], batch) for r in range(4)]
        for r in range(4):
            if scratch[r] is not None:
                torch._foreach_copy_(wide[r], pieces[r])
        if bias_correction:
            _fused(*wide, [steps[i] for i, _, _ in batch], scale, **hyper)
        else:
            _uncorrected(*wide, grad_scale=grad_scale, **hyper)
        for r in (0, 2, 3):  # back into the 16-bit parameters and states, rounded to nearest
            if scratch[r] is not None:
                torch._foreach_copy_(pieces[r], wide[r])
        _copy_out([None if flat_copies[i] is None else flat_copies[i][a:b] for i, a, b in batch], wide[0])


def _fused(ps, gs, ms, vs, steps, scale, *, lr, beta1, beta2, eps, weight_decay, adamw) -> None:
    fused = torch._fused_adamw_ if adamw else torch._fused_adam_
    fused(ps, gs, ms, vs, [], steps, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
          amsgrad=False, maximize=False, grad_scale=scale, found_inf=None)


def _uncorrected(ps, gs, ms, vs, *, grad_scale, lr, beta1, beta2, eps, weight_decay, adamw) -> None:
    """Adam/AdamW without bias correction in foreach ops, on float32 scratch gradients ``gs``
    (overwritten: they end as the denominator)."""
    if grad_scale != 1.0:
        torch._foreach_div_(gs, grad_scale)
    if weight_decay:
        if adamw:
            torch._foreach_mul_(ps, 1.0 - lr * weight_decay)
        else:
            torch._foreach_add_(gs, ps, alpha=weight_decay)
    torch._foreach_lerp_(ms, gs, 1.0 - beta1)
    torch._foreach_mul_(vs, beta2)
    torch._foreach_addcmul_(vs, gs, gs, value=1.0 - beta2)
    torch._foreach_copy_(gs, vs)
    torch._foreach_sqrt_(gs)
    torch._foreach_add_(gs, eps)
    torch._foreach_addcdiv_(ps, ms, gs, value=-lr)


def _copy_out(copies: list[torch.Tensor | None], params: list[torch.Tensor]) -> None:
    pairs = [(c, p) for c, p in zip(copies, params, strict=True) if c is not None]
    if pairs:
        torch._foreach_copy_([c for c, _ in pairs], [p for _, p in pairs])


def _views(scratch: torch.Tensor, batch: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    views, offset = [], 0
    for _, a, b in batch:
        views.append(scratch[offset:offset + b - a])
        offset += b - a
    return views


def _batches(sizes: list[int], limit: int):
    """Cut tensors of ``sizes`` elements into batches of ``(tensor index, start, stop)`` pieces that
    hold at most ``limit`` elements together (a tensor larger than ``limit`` spans batches)."""
    batch, room = [], limit
    for i, n in enumerate(sizes):
        start = 0
        while start < n:
            take = min(n - start, room)
            batch.append((i, start, start + take))
            start, room = start + take, room - take
            if room == 0:
                yield batch
                batch, room = [], limit
    if batch:
        yield batch
