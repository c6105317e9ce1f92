"""The CPU kernels this project writes in C (worker/models/*.c): built and loaded here.

Each source is compiled on first use with the system's C compiler (under a second) into
~/.cache/vramledger/kernels, named by a hash of the source, the headers beside it and the flags,
and loaded with ctypes after torch, so the kernels' OpenMP threads are torch's own pool. They need
AVX-512; where that or the compiler is missing, `load` returns None (saying why once) and callers
keep torch's ops.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
FLAGS = ["-O3", "-mavx512f", "-mfma", "-fopenmp", "-shared", "-fPIC"]


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "vramledger" / "kernels"


def build(source: Path, into: Path | None = None) -> Path:
    """The shared library for this source and flags, compiled unless the cache already holds it."""
    compiler = os.environ.get("CC", "cc")
    # The headers beside the source count too: a change to one rebuilds every kernel.
    text = b"".join(path.read_bytes() for path in [source, *sorted(source.parent.glob("*.h"))])
    key = hashlib.sha256(text + " ".join([compiler, *FLAGS]).encode()).hexdigest()[:16]
    into = into or cache_dir()
    into.mkdir(parents=True, exist_ok=True)
    library = into / f"{source.stem}-{key}.so"
    if not library.exists():
        # Built under a private name and renamed: processes starting together never load half a file.
        fd, partial = tempfile.mkstemp(suffix=".so", dir=into)
        os.close(fd)
        try:
            subprocess.run([compiler, *FLAGS, str(source), "-o", partial], check=True, capture_output=True,
                           text=True, timeout=120)
            os.replace(partial, library)
        finally:
            Path(partial).unlink(missing_ok=True)
    return library


@functools.cache
def load(stem: str) -> ctypes.CDLL | None:
    """The library built from HERE/<stem>.c, or None where it cannot run."""
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        log.info("no AVX-512 on this CPU: %s stays with torch's ops", stem)
        return None
    try:
        return ctypes.CDLL(str(build(HERE / f"{stem}.c")))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("the %s kernel could not be built (%s): torch's ops run instead", stem,
                    getattr(e, "stderr", None) or e)
        return None


def function(stem: str, name: str, *argtypes) -> ctypes._CFuncPtr | None:
    """A kernel's C function with its argument types set, or None where the library cannot run."""
    library = load(stem)
    if library is None:
        return None
    found = getattr(library, name)
    found.argtypes, found.restype = list(argtypes), None
    return found
