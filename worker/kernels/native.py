"""The build of the CPU kernels this project writes in C (worker/kernels/*.c): compiled and loaded here.

Each source is compiled on first use with the system's C compiler (under a second) into
~/.cache/vramledger/kernels, named by a hash of the source, the headers beside it and the flags,
and loaded with ctypes after torch, so the kernels' OpenMP threads are torch's own pool. They are
built for AVX-512 where the CPU has it, and for AVX2 and FMA where it has those only: vec16.h then
makes each 16-lane vector a pair of 256-bit ones. Where neither or the compiler is missing, `load`
returns None (saying why once) and callers keep torch's ops.

An image built once for many machines ships them prebuilt, for both instruction sets:
`python -m vramledger.worker.kernels.native DIR` builds every kernel into DIR, and VRAMLEDGER_KERNELS_DIR=DIR
makes `load` take a library from there before it compiles anything.

A kernel that allocates scratch returns a status (0, or KERNEL_OUT_OF_MEMORY from vec16.h where its
scratch could not be had): `function(..., returns_status=True)` wraps it so that the status raises
MemoryError naming the kernel, instead of the call going on over memory it does not hold.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]
LIBRARIES = ["-lm"]  # after the source: the linker keeps only libraries that something before them needs
ISA_FLAGS = {"AVX512": ["-mavx512f", "-mfma"], "AVX2": ["-mavx2", "-mfma"]}  # torch's name for the CPU's level
PREBUILT_ENV = "VRAMLEDGER_KERNELS_DIR"
OUT_OF_MEMORY = 1  # vec16.h's KERNEL_OUT_OF_MEMORY


def isa() -> str | None:
    """The instruction set the kernels are built for on this CPU, or None where they cannot run.
    torch reports AVX2 only where FMA is present too (its own AVX2 kernels use it)."""
    capability = torch.backends.cpu.get_cpu_capability()
    return next((name for name in ISA_FLAGS if capability.startswith(name)), None)


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "vramledger" / "kernels"


def library_name(source: Path, target_isa: str) -> str:
    """The library's file name: the source's stem and a hash of the source, the headers beside it
    (a change to one rebuilds every kernel), the compiler and the flags."""
    text = b"".join(path.read_bytes() for path in [source, *sorted(source.parent.glob("*.h"))])
    command = [os.environ.get("CC", "cc"), *FLAGS, *ISA_FLAGS[target_isa], *LIBRARIES]
    return f"{source.stem}-{hashlib.sha256(text + ' '.join(command).encode()).hexdigest()[:16]}.so"


def build(source: Path, into: Path | None = None, target_isa: str = "AVX512") -> Path:
    """The shared library for this source and instruction set, compiled unless the cache holds it."""
    compiler = os.environ.get("CC", "cc")
    flags = FLAGS + ISA_FLAGS[target_isa]
    into = into or cache_dir()
    into.mkdir(parents=True, exist_ok=True)
    library = into / library_name(source, target_isa)
    if not library.exists():
        # Built under a private name and renamed: processes starting together never load half a file.
        fd, partial = tempfile.mkstemp(suffix=".so", dir=into)
        os.close(fd)
        try:
            subprocess.run([compiler, *flags, str(source), *LIBRARIES, "-o", partial], check=True,
                           capture_output=True, text=True, timeout=120)
            os.replace(partial, library)
        finally:
            Path(partial).unlink(missing_ok=True)
    return library


@functools.cache
def load(stem: str) -> ctypes.CDLL | None:
    """The library built from HERE/<stem>.c, or None where it cannot run."""
    level = isa()
    if level is None:
        log.info("neither AVX-512 nor AVX2 on this CPU: %s stays with torch's ops", stem)
        return None
    source = HERE / f"{stem}.c"
    prebuilt = Path(os.environ.get(PREBUILT_ENV, "")) / library_name(source, level)
    try:
        return ctypes.CDLL(str(prebuilt if prebuilt.is_file() else build(source, target_isa=level)))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("the %s kernel could not be built (%s): torch's ops run instead", stem,
                    getattr(e, "stderr", None) or e)
        return None


def function(stem: str, name: str, *argtypes, returns_status: bool = False) -> Callable[..., None] | None:
    """A kernel's C function with its argument types set, or None where the library cannot run.
    returns_status: the C function returns a status, which the returned callable checks."""
    library = load(stem)
    if library is None:
        return None
    found = getattr(library, name)
    found.argtypes, found.restype = list(argtypes), ctypes.c_int if returns_status else None
    return _raising(name, found) if returns_status else found


def _raising(name: str, kernel: Callable[..., int]) -> Callable[..., None]:
    def call(*args) -> None:
        status = kernel(*args)
        if status == OUT_OF_MEMORY:
            raise MemoryError(f"the {name} kernel ran out of memory: its scratch could not be allocated")
        if status != 0:
            raise RuntimeError(f"the {name} kernel failed with status {status}")
    return call


def build_all(into: Path) -> list[Path]:
    """Every kernel for every instruction set, into one directory (an image's prebuilt kernels)."""
    return [build(source, into, level) for source in sorted(HERE.glob("*.c")) for level in ISA_FLAGS]


if __name__ == "__main__":
    for path in build_all(Path(sys.argv[1])):
        print(path)
