"""The registered engine kinds: every module of this package that declares `KIND: EngineKind`, plus any
registered at run time (register()), so a new kind is one module and nothing else lists the kinds."""
from __future__ import annotations

import importlib
import pkgutil
from functools import cache
from pathlib import Path

from vramledger.exporter.engines.kinds import EngineKind

_registered: dict[str, EngineKind] = {}  # by name: kinds from outside this package (tests, plugins)


@cache
def _declared() -> tuple[EngineKind, ...]:
    """The KIND of each module of exporter.engines, imported once (a module that imports another's
    KIND declares none of its own: it is found once, by name)."""
    found: dict[str, EngineKind] = {}
    for module in pkgutil.iter_modules([str(Path(__file__).parent)], __package__ + "."):
        kind = getattr(importlib.import_module(module.name), "KIND", None)
        if isinstance(kind, EngineKind):
            _check_unique(kind, found.values())
            found[kind.name] = kind
    return tuple(found.values())


def kinds() -> tuple[EngineKind, ...]:
    """Every kind, by name: the order of the flags, the docs' table and the hints."""
    return tuple(sorted((*_declared(), *_registered.values()), key=lambda kind: kind.name))


def kind_named(name: str) -> EngineKind | None:
    """The kind whose pod label value (vramledger.io/engine) is `name`; None for no registered kind."""
    return next((kind for kind in kinds() if kind.name == name), None)


def register(kind: EngineKind) -> EngineKind:
    """Adds a kind declared outside this package; its name and flag must be new."""
    _check_unique(kind, kinds())
    _registered[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    """Takes back a kind register() added (a test's toy kind)."""
    _registered.pop(name, None)


def _check_unique(kind: EngineKind, others) -> None:
    for other in others:
        if kind.name == other.name or kind.flag == other.flag:
            raise ValueError(f"engine kind {kind.name} ({kind.flag}) clashes with {other.name} ({other.flag})")
