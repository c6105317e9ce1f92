"""Names of vLLM's sources a version's hooks rely on, as declared in its module of this package.

Each is checked against that vLLM version's own files (tests/vllm_sources.py) by reading them, not
importing them, so a version whose build cannot run here is checked too.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Function:
    """A function or method (qualname "Class.method") and its parameters as the source writes them."""

    module: str
    qualname: str
    signature: str  # ast.unparse of its arguments, in parentheses


@dataclass(frozen=True)
class Imported:
    """A name a module imports from another: the plugin wraps it where that module looks it up."""

    module: str
    name: str
    origin: str


@dataclass(frozen=True)
class Attributes:
    """Attributes of a class's instances: its annotated fields or what its methods assign to self."""

    module: str
    cls: str
    names: tuple[str, ...]


SourceName = Function | Imported | Attributes
