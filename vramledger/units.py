"""Byte sizes: one parser for every size flag, one formatter for every size a person reads."""
from __future__ import annotations

import argparse
import re
from decimal import Decimal

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


class SizeError(ValueError, argparse.ArgumentTypeError):
    """A size that cannot be parsed; argparse shows its message as is."""


# IEC (KiB, Ki, bare K) are powers of 1024, SI with B (kB, MB) powers of 1000, as memory tools spell them.
_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgt", start=1):
    _UNITS.update({_p: 1024 ** _i, _p + "i": 1024 ** _i, _p + "ib": 1024 ** _i, _p + "b": 1000 ** _i})


def parse_size(text: str | int) -> int:
    """Bytes from "2GiB", "512MiB", "1.5G", "100MB" or "1073741824"."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise SizeError(f"size must not be negative: {text}")
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*", str(text))
    unit = _UNITS.get(match.group(2).lower()) if match else None
    if match is None or unit is None:
        raise SizeError(f"invalid size {text!r}: use a number of bytes or a number with a unit, "
                        f"e.g. 1073741824, 512MiB, 2GiB, 1.5G (K/M/G/T and KiB.. are powers of 1024, "
                        f"kB/MB/GB/TB powers of 1000)")
    value = Decimal(match.group(1)) * unit
    if unit == 1 and value != value.to_integral_value():
        raise SizeError(f"invalid size {text!r}: a number of bytes must be whole")
    return int(value)


def format_bytes(n: float | None) -> str:
    """A size for people: "1.50 GiB", "12.3 MiB", "4.0 KiB", "512 B"; "?" when unknown."""
    if n is None:
        return "?"
    for unit, name, digits in ((GiB, "GiB", 2), (MiB, "MiB", 1), (KiB, "KiB", 1)):
        if abs(n) >= unit:
            return f"{n / unit:.{digits}f} {name}"
    return f"{n:.0f} B"
