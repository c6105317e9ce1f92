"""The engines' HTTP client over real sockets: kept-alive connections, a server that closes one,
and each failure sorted into a lifecycle state."""
from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from vramledger.exporter.engines.base import Loading, Unreachable, Wrong
from vramledger.exporter.engines.fetch import HttpClient, WrongStatus, fetch
from vramledger.worker.selfcheck.processes import free_port


class Counted(BaseHTTPRequestHandler):
    """Answers each GET with the number of connections the server has accepted so far."""
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    routes: ClassVar = {"/ok": 200, "/bye": 200, "/loading": 503, "/missing": 404, "/gateway": 502}

    def setup(self):
        super().setup()
        self.server.connections += 1

    def do_GET(self):
        status = self.routes.get(self.path.split("?")[0], 404)
        body = (b'{"status": "loading"}' if status == 503 else str(self.server.connections).encode())
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        # /bye: the connection closed after the answer without saying so, as an idle timeout does.
        self.close_connection = self.path == "/bye"

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Counted)
    httpd.connections = 0
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_connections_are_kept_alive_and_shared_between_threads(server):
    httpd, url = server
    client = HttpClient(5)
    assert [fetch(client, url + "/ok?n=1").text for _ in range(3)] == ["1", "1", "1"]
    threads = [threading.Thread(target=fetch, args=(client, url + "/ok")) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert httpd.connections <= 8  # one at most per request in flight, never one per request
    client.close()


def test_a_connection_the_server_closed_is_replaced_once(server):
    _, url = server
    client = HttpClient(5)
    assert fetch(client, url + "/bye").text == "1"
    assert fetch(client, url + "/ok").text == "2"  # the kept connection was gone: a new one, no error
    assert fetch(client, url + "/ok").text == "2"
    client.close()


def test_each_failure_is_a_state(server):
    _, url = server
    client = HttpClient(0.5)
    with pytest.raises(Loading, match="503 loading"):
        fetch(client, url + "/loading")
    with pytest.raises(WrongStatus, match="HTTP 404") as e:
        fetch(client, url + "/missing")
    assert e.value.status_code == 404
    with pytest.raises(Unreachable, match="502 from a proxy"):
        fetch(client, url + "/gateway")
    with pytest.raises(Unreachable, match="ConnectionRefusedError"):
        fetch(client, f"http://127.0.0.1:{free_port()}/ok")
    client.close()


def test_silence_is_unreachable_and_a_non_http_answer_wrong():
    with socket.socket() as silent, socket.socket() as chatty:
        for s in (silent, chatty):
            s.bind(("127.0.0.1", 0))
            s.listen()

        def babble():
            conn, _ = chatty.accept()
            conn.recv(1024)
            conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
            conn.close()

        threading.Thread(target=babble, daemon=True).start()
        client = HttpClient(0.3)
        with pytest.raises(Unreachable, match="no answer within 0.3 s"):
            fetch(client, f"http://127.0.0.1:{silent.getsockname()[1]}/metrics")
        with pytest.raises(Wrong, match="no HTTP answer"):
            fetch(client, f"http://127.0.0.1:{chatty.getsockname()[1]}/metrics")
        client.close()
