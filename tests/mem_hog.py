"""A real second process that holds memory: allocates and touches N bytes, says so, waits for stdin to close.

Run as a script (python mem_hog.py --bytes N), or use start()/stop()/hog() from a test.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import subprocess
import sys
from collections.abc import Iterator


def _libc():
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bytes", type=int, required=True)
    nbytes = parser.parse_args().bytes
    libc = _libc()
    block = libc.malloc(nbytes)
    if not block:
        sys.exit(f"mem_hog: malloc({nbytes}) failed")
    libc.memset(block, 1, nbytes)  # touch every page: untouched pages are not resident
    print("ready", flush=True)
    sys.stdin.read()  # hold until the parent closes our stdin
    libc.free(block)


def start(nbytes: int) -> subprocess.Popen:
    """Start a hog and return once it holds nbytes."""
    proc = subprocess.Popen([sys.executable, __file__, "--bytes", str(nbytes)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if line.strip() != "ready":
        stop(proc)
        raise RuntimeError(f"mem_hog did not start (said {line!r}, exit code {proc.returncode})")
    return proc


def stop(proc: subprocess.Popen) -> None:
    """Let the hog exit (closing its stdin), killing it if it does not."""
    try:
        proc.stdin.close()
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    finally:
        proc.stdout.close()


@contextlib.contextmanager
def hog(nbytes: int) -> Iterator[subprocess.Popen]:
    """A second process holding nbytes for the duration of the block."""
    proc = start(nbytes)
    try:
        yield proc
    finally:
        stop(proc)


if __name__ == "__main__":
    main()
