"""tests/vllm_cuda_path.py's scenarios, each in a child forked from this process once vLLM is imported.

    PYTHONPATH=.:tests <vLLM venv>/bin/python tests/vllm_fork_server.py

Importing vLLM is half a scenario's time. A child forked after the import stands where a fresh process
stands after its own: nothing of vLLM has run here (no config, no device, no plugin installed) and
this process starts no thread, so no lock is copied held. Each child takes the environment, working
directory and output files its request names, so it runs as `vllm_cuda_path.py SCENARIO` would.

Requests on stdin, one JSON object a line:
    {"run": ID, "argv": [SCENARIO, ARG...], "env": {NAME: VALUE}, "cwd": DIR, "out": FILE, "err": FILE}
    {"kill": ID}
Once a child is reaped, its exit status (negative: the signal that ended it) is written to OUT + ".rc".
Answers "ready" on stdout once vLLM is imported (the rest it prints goes to stderr). When stdin closes,
the children still running are killed.
"""
from __future__ import annotations

import json
import os
import select
import signal
import sys
import traceback

# numpy's and OpenCV's OpenBLAS start a pool of threads on import unless told to use one: a fork wants
# no thread. Each child gets the variable back as it was (they do no numpy BLAS work).
BLAS_THREADS = "OPENBLAS_NUM_THREADS"
GIVEN = {BLAS_THREADS: os.environ.get(BLAS_THREADS)}
os.environ[BLAS_THREADS] = "1"

import vllm_cuda_path  # noqa: E402  # it sets the environment vLLM reads on import


def import_vllm() -> None:
    """What vllm_cuda_path.run imports, once for every child."""
    import vllm.config  # noqa: F401
    import vllm.engine.arg_utils  # noqa: F401
    import vllm.v1.kv_cache_interface  # noqa: F401
    import vllm.v1.worker.gpu_worker  # noqa: F401


def threads() -> int:
    """This process's threads as the kernel counts them (those of C++ libraries too)."""
    return len(os.listdir("/proc/self/task"))


def scenario(request: dict) -> int:
    """In the child: the scenario run as its own process would run it; its exit status."""
    os.chdir(request["cwd"])
    for name, value in GIVEN.items():
        os.environ.pop(name) if value is None else os.environ.update({name: value})
    os.environ.update(request["env"])
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the requests are the server's to read
    for fd, path in ((1, request["out"]), (2, request["err"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    sys.argv = [vllm_cuda_path.__file__, *request["argv"]]
    try:
        vllm_cuda_path.main(request["argv"])
    except SystemExit as stop:  # as the interpreter ends on it
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:  # as an uncaught exception ends a process: its traceback, status 1
        traceback.print_exc()
        return 1
    return 0


def fork(request: dict) -> int:
    if threads() != 1:  # a thread's lock would be copied held into the child
        sys.exit(f"{threads()} threads in the fork server: forking it is not safe")
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            status = scenario(request)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    return pid


def reap(children: dict[int, dict]) -> None:
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        out = children.pop(pid)["out"]
        with open(out + ".rc.part", "w") as f:
            f.write(str(os.waitstatus_to_exitcode(status)))
        os.replace(out + ".rc.part", out + ".rc")  # whole once there


def serve() -> None:
    children: dict[int, dict] = {}  # pid: request
    pids: dict[str, int] = {}  # run id: pid
    pending = b""
    with os.fdopen(os.dup(1), "w") as answer:
        os.dup2(2, 1)  # stdout is for "ready" alone: what vLLM prints on import goes to stderr
        import_vllm()
        answer.write("ready\n")
    while True:
        if select.select([0], [], [], 0.02)[0]:
            data = os.read(0, 1 << 16)
            if not data:
                break
            *lines, pending = (pending + data).split(b"\n")
            for request in map(json.loads, lines):
                if "run" in request:
                    pids[request["run"]] = fork(request)
                    children[pids[request["run"]]] = request
                elif pids.get(request["kill"]) in children:
                    os.kill(pids[request["kill"]], signal.SIGKILL)
        reap(children)
    for pid in children:
        os.kill(pid, signal.SIGKILL)
    for pid in children:
        os.waitpid(pid, 0)


if __name__ == "__main__":
    serve()
