"""Physical bounds on a ledger's values: what no device, host or kernel could truthfully say.

A ledger is another process's word, and the exporter republishes it: a byte count no memory could hold
(10**400 does not even convert to a float), a pid the kernel never gives, a 600 KB label with newlines.
The ledger document's types carry these bounds (ledger_document.py: Bytes, Pid, Label, ...), so its JSON
Schema states them and its one reader (ledger_reading.py) refuses a value beyond them.
"""
from __future__ import annotations

import reprlib
from dataclasses import dataclass
from typing import Any, Union

MAX_BYTES = 1 << 50  # 1 PiB: above the memory of any device or host an engine runs on
PID_MAX = 1 << 22  # the kernel's PID_MAX_LIMIT on 64-bit: the most /proc/sys/kernel/pid_max allows
MAX_LABEL = 256  # characters of a label value an engine names (a model path, a version, a component)
MAX_RANKS = 1024  # ranks of one server's ledger, and the highest rank number; its other processes
MAX_TOKENS = 1 << 40  # tokens of a KV cache: a PiB of memory at a byte per token is fewer
MAX_ENTRIES = 256  # entries of one rank's ledger (each a series)
_SHOWN = 60  # characters of a refused value a message repeats


def shown(value: object) -> str:
    """repr(value), clipped: a message repeats at most _SHOWN characters of what an engine sent."""
    if isinstance(value, (list, dict)):  # a few of its items: the whole of a large one is costly to write out
        text = _FEW.repr(value)
        return text if len(text) <= _SHOWN else f"{text[:_SHOWN]}... ({len(value)} items)"
    text = repr(value) if not isinstance(value, int) or abs(value) < 1 << 64 else f"a {value.bit_length()}-bit int"
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN]}... ({len(text)} characters)"


_FEW = reprlib.Repr()
_FEW.maxlevel, _FEW.maxlist, _FEW.maxdict, _FEW.maxstring, _FEW.maxother, _FEW.maxlong = 2, 3, 3, 20, 20, 20


class OutOfBounds(ValueError):
    """A value no engine could truthfully say."""


@dataclass(frozen=True)
class Within:
    """A number's bound, low..high inclusive: typing.Annotated metadata of the document's types."""

    low: float
    high: float

    def holds(self, value: object) -> bool:
        """Whether a number is within; anything else is for its type to refuse."""
        return not isinstance(value, (int, float)) or self.low <= value <= self.high

    def __str__(self) -> str:
        return f"within {self.low}..{self.high}"

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: Any) -> dict:
        # Called by the schema generator alone (pydantic); the package imports without it.
        return {**handler(core_schema), "minimum": self.low, "maximum": self.high}


@dataclass(frozen=True)
class LabelText:
    """Text the exporter republishes as a label value: at most MAX_LABEL printable characters."""

    def holds(self, value: object) -> bool:
        """Whether a text could be a label value; anything else is for its type to refuse."""
        return not isinstance(value, str) or (len(value) <= MAX_LABEL and value.isprintable())

    def __str__(self) -> str:
        return f"a label value (at most {MAX_LABEL} printable characters)"

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: Any) -> dict:
        # No control character (a newline ends a sample line); the reader also refuses Python's other
        # unprintable characters, as the exporter's labels do.
        return {**handler(core_schema), "maxLength": MAX_LABEL, "pattern": r"^[^\x00-\x1f\x7f]*$"}


@dataclass(frozen=True)
class Most:
    """A list's most items: each is a series the exporter publishes, or a process it reads."""

    items: int

    def holds(self, value: object) -> bool:
        return not isinstance(value, list) or len(value) <= self.items

    def __str__(self) -> str:
        return f"a list of at most {self.items}"

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: Any) -> dict:
        return {**handler(core_schema), "maxItems": self.items}


BOUNDS = (Within, LabelText, Most)
Bound = Union[Within, LabelText, Most]
