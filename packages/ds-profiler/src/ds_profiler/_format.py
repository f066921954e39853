"""Human-readable numbers: ``1.23 G``, ``4.5 GMACs``, ``12.3 ms``, ``81.9 TFLOPS``.

Counts use the decimal units K, M, G, T (10^3 .. 10^12); durations use s, ms, us. Two decimals,
trailing zeros dropped, as in DeepSpeed's printed profiles.
"""

from __future__ import annotations

_COUNT_UNITS = (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3))
_TIME_UNITS = (("", 1.0), ("m", 1e-3), ("u", 1e-6), ("n", 1e-9))
PRECISION = 2


def _fixed(value: float, precision: int) -> str:
    text = f"{value:.{precision}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def number_to_string(num: float, precision: int = PRECISION) -> str:
    """``1234567 -> '1.23 M'``; below 1000 no unit: ``'12 '`` (the unit slot stays, as in DeepSpeed)."""
    for unit, magnitude in _COUNT_UNITS:
        if abs(num) >= magnitude:
            return f"{_fixed(num / magnitude, precision)} {unit}"
    return f"{_fixed(num, precision)} "


def flops_to_string(flops: float, precision: int = PRECISION) -> str:
    """A flop count: ``'2.2 G'`` (DeepSpeed's ``fwd flops per GPU`` style)."""
    return number_to_string(flops, precision).rstrip()


def macs_to_string(macs: float, precision: int = PRECISION) -> str:
    return f"{number_to_string(macs, precision)}MACs"


def rate_to_string(flops_per_second: float, precision: int = PRECISION) -> str:
    return f"{number_to_string(flops_per_second, precision)}FLOPS"


def params_to_string(params: float, precision: int = PRECISION) -> str:
    return number_to_string(params, precision).rstrip()


def duration_to_string(seconds: float, precision: int = PRECISION) -> str:
    if seconds == 0:
        return "0 s"
    for unit, magnitude in _TIME_UNITS:
        if abs(seconds) >= magnitude:
            return f"{_fixed(seconds / magnitude, precision)} {unit}s"
    return f"{_fixed(seconds / 1e-9, precision)} ns"


_PARSE_UNITS = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_PARSE_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def string_to_number(text: str) -> float:
    """Inverse of the count formatters (to printed precision): ``'1.23 GMACs' -> 1.23e9``."""
    text = text.strip()
    for suffix in ("MACs", "FLOPS"):
        if text.endswith(suffix):
            text = text[: -len(suffix)].strip()
    value, _, unit = text.partition(" ")
    if not unit and value and value[-1] in _PARSE_UNITS and value[-1].isalpha():
        value, unit = value[:-1], value[-1]
    if unit not in _PARSE_UNITS:
        raise ValueError(f"cannot parse {text!r}: unit must be one of K, M, G, T or none")
    return float(value) * _PARSE_UNITS[unit]


def string_to_duration(text: str) -> float:
    value, _, unit = text.strip().partition(" ")
    if unit not in _PARSE_TIME:
        raise ValueError(f"cannot parse duration {text!r}: unit must be one of s, ms, us, ns")
    return float(value) * _PARSE_TIME[unit]
