"""Read numbers with units the way students type them, and print them back.

``parse_quantity("1.34GB")`` gives ``Quantity(1.34e9, "B")``: a value in the
base unit plus the unit's dimension. Numeric quiz questions state their unit
("GB", "tok/s", "ms"); an answer typed without a unit is taken to be in that
unit, and an answer typed with a compatible unit ("1340 MB" for a GB question)
is converted. Incompatible units ("GB/s" for a GB question) are an error with a
message that says which unit the question wants.

Invariants:
- Every known unit name maps to exactly one (dimension, factor) pair.
- SI prefixes are powers of 1000; binary prefixes (Ki, Mi, Gi, Ti) apply to
  bytes only and are powers of 1024.
- Lowercase k/m/g/t in front of bytes, FLOP or tokens mean kilo/mega/giga/tera
  (nobody means milli-bytes); in front of seconds, "m" is milli.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["Quantity", "UnitError", "parse_quantity", "parse_unit", "format_quantity",
           "DECIMAL_SLIPS", "BINARY_SLIPS"]

# The unit slips a wrong number may be off by, named: the exercise checks
# (`checks.diagnosis`) and the quiz marking (`numeric_marking`) both say which one they see.
DECIMAL_SLIPS = {1e3: "10³", 1e6: "10⁶", 1e9: "10⁹", 1e12: "10¹²"}
BINARY_SLIPS = {1.024: "KiB against KB (1024 against 1000 bytes)",
                2**20 / 1e6: "MiB against MB (2²⁰ against 10⁶ bytes)",
                2**30 / 1e9: "GiB against GB (2³⁰ against 10⁹ bytes)",
                2**40 / 1e12: "TiB against TB (2⁴⁰ against 10¹² bytes)"}


class UnitError(ValueError):
    """The text is not a number, or its unit is unknown or incompatible."""


@dataclass(frozen=True)
class Quantity:
    value: float  # in the base unit of ``dim``
    dim: str  # "B", "FLOP", "FLOP/s", "B/s", "tok", "tok/s", "s", "$", "%", "x", "" ...
    unit_given: bool  # False when the text was a bare number


# dimension -> list of (names, factor); prefixes are added below.
_SI = {"k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_SI_LOWER_BIG = {"m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}  # "mb", "gb" mean MB, GB
_BINARY = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "ki": 2.0**10}
_TIME_PREFIX = {"m": 1e-3, "u": 1e-6, "µ": 1e-6, "μ": 1e-6, "n": 1e-9}

_BASES: dict[str, tuple[str, ...]] = {
    "B": ("B", "byte", "bytes"),
    "FLOP": ("FLOP", "FLOPs", "flop"),
    "FLOP/s": ("FLOP/s", "FLOPS", "flop/s", "FLOPs/s", "flops"),
    "B/s": ("B/s", "Bps", "byte/s", "bytes/s"),
    "tok": ("tok", "tokens", "token"),
    "tok/s": ("tok/s", "tokens/s", "token/s", "tps"),
    "s": ("s", "sec", "secs", "second", "seconds"),
    "params": ("params", "parameters", "param"),
    "seq": ("seq", "seqs", "sequences", "sequence"),
    "req/s": ("req/s", "requests/s", "rps"),
    "step": ("step", "steps"),
}
_PLAIN: dict[str, tuple[str, float]] = {
    "%": ("%", 1.0),
    "percent": ("%", 1.0),
    "x": ("x", 1.0),
    "×": ("x", 1.0),
    "times": ("x", 1.0),
    "$": ("$", 1.0),
    "usd": ("$", 1.0),
    "dollars": ("$", 1.0),
    "min": ("s", 60.0),
    "h": ("s", 3600.0),
    "hour": ("s", 3600.0),
    "hours": ("s", 3600.0),
    "b": ("B", 1.0),  # people type "gb"; a bare "b" is bytes too here
}
# Counts written with a suffix: "70B params", "7B" (billions), "405B".
_COUNT_SUFFIX = {"thousand": 1e3, "million": 1e6, "billion": 1e9, "trillion": 1e12}


def _build_table() -> dict[str, tuple[str, float]]:
    table: dict[str, tuple[str, float]] = dict(_PLAIN)
    for dim, names in _BASES.items():
        for name in names:
            table[name] = (dim, 1.0)
            if dim in ("s",):
                for p, f in _TIME_PREFIX.items():
                    table[p + name] = (dim, f)
                table["k" + name] = (dim, 1e3)
                continue
            for p, f in _SI.items():
                table[p + name] = (dim, f)
            for p, f in _SI_LOWER_BIG.items():
                table.setdefault(p + name, (dim, f))
            if dim in ("B", "B/s"):
                for p, f in _BINARY.items():
                    table[p + name] = (dim, f)
    for name, f in _COUNT_SUFFIX.items():
        table[name] = ("", f)
    return table


_TABLE = _build_table()
_TABLE_CASEFOLD: dict[str, tuple[str, float]] = {}
for _name, _entry in _TABLE.items():
    _TABLE_CASEFOLD.setdefault(_name.casefold(), _entry)

_NUMBER = re.compile(
    r"""^\s*
    (?P<sign>[-+−]?)\s*\$?\s*
    (?P<num>(\d{1,3}(?:[,_]\d{3})+|\d+)?(\.\d+)?)   # 1,340  1.34  .5
    (?:\s*[eE]\s*(?P<exp>[-+−]?\d+))?        # e9
    (?:\s*(?:[x×*·]|\\times)\s*10\s*(?:\^|\*\*)\s*(?P<exp10>[-+−]?\d+))?   # × 10^9
    \s*(?P<unit>.*?)\s*$""",
    re.VERBOSE,
)


def parse_unit(unit: str) -> tuple[str, float]:
    """Return (dimension, factor-to-base) for a unit name; raise UnitError if unknown."""
    u = unit.strip().replace(" ", "")
    if u == "":
        return ("", 1.0)
    if u in _TABLE:
        return _TABLE[u]
    if u.casefold() in _TABLE_CASEFOLD:
        return _TABLE_CASEFOLD[u.casefold()]
    raise UnitError(f"unknown unit {unit!r}")


def parse_quantity(text: str | float | int) -> Quantity:
    """Parse '26e9', '26 GB', '1.34GB', '1,340 MB', '3 × 10^9', '$0.87', '60 %'."""
    if isinstance(text, bool):
        raise UnitError("expected a number, got True/False")
    if isinstance(text, (int, float)):
        if not math.isfinite(float(text)):
            raise UnitError("expected a finite number")
        return Quantity(float(text), "", False)
    s = str(text).strip()
    if not s:
        raise UnitError("the answer is empty")
    m = _NUMBER.match(s)
    if not m or not m.group("num") or not any(c.isdigit() for c in m.group("num")):
        raise UnitError(f"{s!r} is not a number")
    digits = m.group("num").replace(",", "").replace("_", "").replace(" ", "")
    try:
        value = float(digits)
    except ValueError as exc:  # pragma: no cover - regex already restricts this
        raise UnitError(f"{s!r} is not a number") from exc
    if m.group("exp"):
        value *= 10.0 ** int(m.group("exp").replace("−", "-"))
    if m.group("exp10"):
        value *= 10.0 ** int(m.group("exp10").replace("−", "-"))
    if m.group("sign") in ("-", "−"):
        value = -value
    unit = m.group("unit")
    if s.lstrip("+-− ").startswith("$") and not unit:
        unit = "$"
    dim, factor = parse_unit(unit)
    return Quantity(value * factor, dim, bool(unit))


def format_quantity(value: float, unit: str = "", digits: int = 3) -> str:
    """Format like '1.34 GB' or '14.3 tok/s'; big or tiny values use e-notation."""
    text = f"{value:.{digits}g}"
    if "e" in text:  # 2.6e+10 -> 2.6e10, 2.5e-07 -> 2.5e-7
        mant, exp = text.split("e")
        text = f"{mant}e{int(exp)}"
    if unit in ("", None):
        return text
    if unit in ("%", "x", "×"):
        return f"{text}{'×' if unit in ('x', '×') else '%'}"
    if unit == "$":
        return f"${text}"
    return f"{text} {unit}"
