"""free_port, wait_until and wait_http (worker/selfcheck/processes.py): the one copy that selfcheck,
scripts/local_stack.py, bench/ and the tests use, against real sockets and real processes."""
from __future__ import annotations

import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from vramledger.worker.selfcheck.processes import (
    Processes,
    ProcessExited,
    WaitTimedOut,
    free_port,
    wait_http,
    wait_until,
)

DIES = "import sys; print('loading the model'); print('error: no such model', flush=True); sys.exit(3)"
ROOT = Path(__file__).resolve().parent.parent
SLEEPS = "import time; print('still loading', flush=True); time.sleep(60)"


@pytest.fixture
def loading_server():
    """A real HTTP server whose /health answers 503 twice, then 200."""
    answers = [503, 503]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(answers.pop(0) if answers else 200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_free_port_can_be_listened_on():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        assert s.getsockname()[1] == port


def test_wait_http_returns_once_the_server_answers_200_and_records_what_it_answered(loading_server):
    seen: list[int] = []
    wait_http(loading_server + "/health", 30, seen=seen)
    assert seen == [503, 503, 200]


def test_other_statuses_may_count_as_an_answer(loading_server):
    seen: list[int] = []
    wait_http(loading_server + "/health", 30, ok=(200, 503), seen=seen)
    assert seen == [503]


def test_a_dead_process_fails_the_wait_at_once_with_its_exit_code_and_output(tmp_path):
    log = tmp_path / "dies.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-c", DIES], stdout=out, stderr=subprocess.STDOUT)
    proc.wait(30)
    # The timeout is far off: only the process's exit can end this wait in time for the assertion.
    with pytest.raises(ProcessExited) as e:
        wait_http(f"http://127.0.0.1:{free_port()}/health", 600, proc, log)
    message = str(e.value)
    assert f"(pid {proc.pid}) exited with code 3 while waiting for http://127.0.0.1:" in message
    assert message.endswith("loading the model\nerror: no such model\n")
    assert e.value.last_error() == "error: no such model"


def test_a_started_process_brings_its_own_log(tmp_path):
    with Processes(tmp_path) as procs:
        started = procs.start("dies", [sys.executable, "-c", DIES])
        started.popen.wait(30)
        with pytest.raises(ProcessExited) as e:
            wait_http(f"http://127.0.0.1:{free_port()}/health", 600, started)
    assert e.value.headline.startswith(f"dies (pid {started.pid}) exited with code 3 while waiting for ")
    assert "error: no such model" in str(e.value)


def test_a_timeout_names_what_was_awaited_and_ends_with_the_log(tmp_path):
    log = tmp_path / "sleeps.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-c", SLEEPS], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: log.read_text(), 30, "the first line", proc, log, interval=0.05)
        url = f"http://127.0.0.1:{free_port()}/health"
        with pytest.raises(WaitTimedOut) as e:
            wait_http(url, 0.5, proc, log)
    finally:
        proc.kill()
        proc.wait(30)
    assert isinstance(e.value, TimeoutError)
    assert e.value.headline == f"timed out after 0.5 s waiting for {url} to answer 200"
    assert str(e.value) == e.value.headline + "; its last output:\nstill loading\n"


def test_check_gives_up_the_wait(loading_server):
    class Stop(Exception):
        pass

    def check():
        raise Stop

    with pytest.raises(Stop):
        wait_http(loading_server + "/health", 30, check=check)


def test_wait_until_returns_what_the_predicate_found():
    found = iter([None, 0, "", "here"])
    assert wait_until(lambda: next(found), 30, "a value", interval=0.01) == "here"


def test_scripts_local_stack_gets_them_without_torch():
    """`make run`'s launcher imports these helpers: it must not pay for (or need) torch."""
    probe = ("import sys; sys.path.insert(0, 'scripts'); import local_stack; "
             "print(local_stack.wait_http.__module__, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["vramledger.worker.selfcheck.processes", "False"], done.stderr
