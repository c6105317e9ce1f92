"""A foreign process that holds device memory: `python -m vramledger.worker.selfcheck.neighbour --device D --bytes N`.

It allocates and touches N bytes (a torch tensor on CUDA, a filled buffer on the CPU), prints
"ready", and holds them until its stdin closes or it is signalled.
"""
from __future__ import annotations

import argparse
import select
import subprocess
import sys

from vramledger.worker.selfcheck.processes import Processes, Started


def hold(device: str, nbytes: int):
    if device.startswith("cuda"):
        import torch

        block = torch.empty(nbytes, dtype=torch.uint8, device=device)
        block.fill_(1)
        torch.cuda.synchronize(block.device)
        return block
    return bytearray(b"\x01") * nbytes  # every page written, so every page is resident


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--bytes", type=int, required=True)
    args = p.parse_args(argv)
    held = hold(args.device, args.bytes)  # noqa: F841 (held until exit)
    print("ready", flush=True)
    sys.stdin.read()
    return 0


def start_neighbour(procs: Processes, name: str, device: str, nbytes: int, timeout: float = 120.0) -> Started:
    """Start a neighbour and return once it holds its memory."""
    proc = procs.start(name, [sys.executable, "-m", "vramledger.worker.selfcheck.neighbour", "--device", device,
                              "--bytes", str(nbytes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    said = proc.popen.stdout
    assert said is not None  # started with stdout=PIPE
    ready, _, _ = select.select([said], [], [], timeout)
    line = said.readline().decode().strip() if ready else ""
    if line != "ready":
        procs.stop(proc)
        raise RuntimeError(f"the neighbour process did not start (said {line!r}, exit code "
                           f"{proc.popen.returncode}); it was to hold {nbytes} bytes on {device}")
    return proc


if __name__ == "__main__":
    sys.exit(main())
