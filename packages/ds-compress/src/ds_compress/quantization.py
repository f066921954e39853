"""Quantizers: symmetric/asymmetric on a 2**bits grid, ternary (2 bits), binary (1 bit).

Every function returns ``(codes, scale, zero_point, offset)`` through ``quantize_codes`` so that the
value is ``(codes - offset) * scale + zero_point`` per group: the same numbers serve the
straight-through forward (``fake_quantize``) and the packed storage of ``redundancy_clean``.
"""

from __future__ import annotations

import torch

_TINY = 1e-12


def _round(x: torch.Tensor, rounding: str) -> torch.Tensor:
    if rounding == "stochastic":
        return torch.floor(x + torch.rand_like(x))
    return torch.round(x)


def quantize_codes(x: torch.Tensor, bits: int, groups: int = 1, quantization_type: str = "symmetric",
                   rounding: str = "nearest", min_value: torch.Tensor | None = None,
                   max_value: torch.Tensor | None = None):
    """Integer codes (float tensor, shape ``(groups, n)``) and per-group scale/zero point/offset.

    * symmetric (bits >= 3): ``scale = 2 * max|x| / 2**bits``, codes in ``[-2**(bits-1), 2**(bits-1) - 1]``.
    * asymmetric (bits >= 3): ``scale = (max - min) / 2**bits``, zero point ``round(min / scale) * scale``,
      codes in ``[0, 2**bits - 1]``.
    * bits == 2: ternary, ``alpha * {-1, 0, 1}`` with threshold ``0.7 * mean|x|``.
    * bits == 1: binary, ``mean|x| * sign(x)``.

    ``min_value``/``max_value`` (shape ``(groups, 1)``) replace the range of ``x`` (static activations).
    """
    if x.numel() % groups:
        raise ValueError(f"quantize_groups={groups} does not divide the {x.numel()} elements of a "
                         f"tensor of shape {tuple(x.shape)}")
    flat = x.reshape(groups, -1)
    zero = torch.zeros((groups, 1), dtype=flat.dtype, device=flat.device)
    if bits == 1:
        alpha = flat.abs().mean(dim=1, keepdim=True)
        return torch.sign(flat), alpha, zero, 0.0
    if bits == 2:
        threshold = 0.7 * flat.abs().mean(dim=1, keepdim=True)
        codes = (flat > threshold).to(flat.dtype) - (flat < -threshold).to(flat.dtype)
        kept = codes.abs()
        alpha = (flat.abs() * kept).sum(dim=1, keepdim=True) / kept.sum(dim=1, keepdim=True).clamp_min(1)
        return codes, alpha, zero, 0.0
    levels = 2 ** bits
    if quantization_type == "symmetric":
        if min_value is None:
            absmax = flat.abs().amax(dim=1, keepdim=True)
        else:
            absmax = torch.maximum(min_value.abs(), max_value.abs()).to(flat.dtype)
        scale = (2 * absmax / levels).clamp_min(_TINY)
        codes = _round(flat / scale, rounding).clamp(-levels // 2, levels // 2 - 1)
        return codes, scale, zero, 0.0
    if quantization_type != "asymmetric":
        raise ValueError(f"quantization_type must be 'symmetric' or 'asymmetric', got {quantization_type!r}")
    lo = flat.amin(dim=1, keepdim=True) if min_value is None else min_value.to(flat.dtype)
    hi = flat.amax(dim=1, keepdim=True) if max_value is None else max_value.to(flat.dtype)
    scale = ((hi - lo) / levels).clamp_min(_TINY)
    zero_point = torch.round(lo / scale) * scale
    codes = _round((flat - zero_point) / scale, rounding).clamp(0, levels - 1)
    return codes, scale, zero_point, 0.0


def quantize(x: torch.Tensor, bits: int, groups: int = 1, quantization_type: str = "symmetric",
             rounding: str = "nearest", min_value=None, max_value=None) -> torch.Tensor:
    """The quantized value of ``x`` (no gradient path)."""
    codes, scale, zero_point, offset = quantize_codes(x, bits, groups, quantization_type, rounding,
                                                      min_value, max_value)
    return ((codes - offset) * scale + zero_point).reshape(x.shape)


def fake_quantize(x: torch.Tensor, bits: int, groups: int = 1, quantization_type: str = "symmetric",
                  rounding: str = "nearest", min_value=None, max_value=None) -> torch.Tensor:
    """Quantized forward, identity (straight-through) backward."""
    with torch.no_grad():
        q = quantize(x, bits, groups, quantization_type, rounding, min_value, max_value)
    return x + (q - x).detach()


# ------------------------------------------------------------------------------- packed storage
def quantize_for_storage(x: torch.Tensor, bits: int, groups: int, quantization_type: str):
    """Quantized values of ``x`` and the scale/zero point of each storage unit.

    A unit is a row of ``x`` when the groups are whole rows (``rows % groups == 0``: each row
    repeats its group's scale), so that cutting rows or columns later keeps every value exact;
    otherwise a unit is a group.
    """
    codes, scale, zero_point, offset = quantize_codes(x, bits, groups, quantization_type)
    values = ((codes - offset) * scale + zero_point).reshape(x.shape)
    rows = x.shape[0]
    if rows % groups == 0:
        scale = scale.repeat_interleave(rows // groups, dim=0)
        zero_point = zero_point.repeat_interleave(rows // groups, dim=0)
    return values, scale.reshape(-1), zero_point.reshape(-1)


def _offset(bits: int, quantization_type: str) -> int:
    if bits <= 2:
        return 1
    return 2 ** (bits - 1) if quantization_type == "symmetric" else 0


def pack_values(values: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, bits: int,
                quantization_type: str) -> dict[str, torch.Tensor]:
    """Values already on their grid (``quantize_for_storage``) as unsigned codes, two per byte at
    <= 4 bits, plus the float32 scale and zero point of each unit."""
    units = scale.numel()
    flat = values.reshape(units, -1)
    codes = torch.round((flat - zero_point.view(-1, 1)) / scale.view(-1, 1)) + _offset(bits, quantization_type)
    unsigned = codes.reshape(-1).clamp(0, 2 ** max(bits, 2) - 1).to(torch.uint8)
    if bits <= 4:
        if unsigned.numel() % 2:
            unsigned = torch.cat([unsigned, unsigned.new_zeros(1)])
        unsigned = unsigned[0::2] | (unsigned[1::2] << 4)
    return {"codes": unsigned, "scale": scale.to(torch.float32), "zero_point": zero_point.to(torch.float32),
            "meta": torch.tensor([bits, units, *values.shape], dtype=torch.int32)}


def pack(x: torch.Tensor, bits: int, groups: int, quantization_type: str) -> dict[str, torch.Tensor]:
    """The quantized ``x`` in packed storage."""
    return pack_values(*quantize_for_storage(x, bits, groups, quantization_type), bits, quantization_type)


def unpack(store: dict[str, torch.Tensor], quantization_type: str, dtype=torch.float32) -> torch.Tensor:
    """Inverse of ``pack``: the dequantized tensor."""
    bits, units, *shape = (int(v) for v in store["meta"])
    numel = 1
    for s in shape:
        numel *= s
    codes = store["codes"]
    if bits <= 4:
        codes = torch.stack([codes & 0xF, codes >> 4], dim=1).reshape(-1)[:numel]
    values = codes.to(dtype).reshape(units, -1) - _offset(bits, quantization_type)
    out = values * store["scale"].to(dtype).view(-1, 1) + store["zero_point"].to(dtype).view(-1, 1)
    return out.reshape(shape)


class ActivationQuantizer(torch.nn.Module):
    """Quantizes a layer input: dynamic (range of each token/image) or static (running min/max).

    Static: in training the range follows ``momentum * old + (1 - momentum) * batch`` (the first batch
    sets it); in eval the stored range is used.  Straight-through gradient.
    """

    def __init__(self, bits: int, quantization_type: str, range_calibration: str, momentum: float = 0.95,
                 per_sample: bool = False):
        super().__init__()
        self.bits, self.quantization_type = bits, quantization_type
        self.range_calibration, self.momentum, self.per_sample = range_calibration, momentum, per_sample
        self.register_buffer("x_min_max", torch.zeros(2))
        self.register_buffer("initialized", torch.zeros((), dtype=torch.bool))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.range_calibration == "dynamic":
            rows = x.shape[0] if self.per_sample else x.numel() // x.shape[-1]
            return fake_quantize(x, self.bits, rows, self.quantization_type)
        if self.training:
            with torch.no_grad():
                batch = torch.stack([x.min(), x.max()]).to(self.x_min_max.dtype)
                if bool(self.initialized):
                    self.x_min_max.mul_(self.momentum).add_((1 - self.momentum) * batch)
                else:
                    self.x_min_max.copy_(batch)
                    self.initialized.fill_(True)
        lo, hi = self.x_min_max[0].view(1, 1), self.x_min_max[1].view(1, 1)
        return fake_quantize(x, self.bits, 1, self.quantization_type, "nearest", lo, hi)

    def extra_repr(self) -> str:
        return f"bits={self.bits}, {self.quantization_type}, {self.range_calibration}"
