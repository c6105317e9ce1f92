"""GETs of the engines' routes over kept-alive connections, each failure sorted into a lifecycle state.

Every engine is read on every scrape, so a GET's own cost counts: wire.py speaks the little HTTP this
is (no proxies: a proxy from the environment must not sit between the exporter and its engines).

Each GET has one deadline for all of it (connect, send, status line, headers, body): a socket timeout
alone applies to each receive, so an engine answering a byte at a time would hold a read for as long
as it liked. And its body is bounded, so no engine can make the exporter hold more than MAX_BODY.
"""
from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
import time
from dataclasses import dataclass

from vramledger.exporter.engines.base import Loading, Unreachable, Wrong
from vramledger.exporter.engines.wire import MAX_BODY, Server, SlowAnswer, TooLarge, get, request

__all__ = ["MAX_BODY", "HttpClient", "Response", "SlowAnswer", "TooLarge", "WrongStatus", "fetch"]

# A proxy between the exporter and the engine answers these when the engine behind it is gone.
_GATEWAY = (502, 504)


@dataclass(frozen=True)
class Response:
    """A whole HTTP response."""
    status_code: int
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self):
        """The JSON body; raises ValueError when it is none."""
        return json.loads(self.content)


class HttpClient:
    """GETs, each within one timeout from connect to the body's last byte, reusing idle connections per
    server; safe to share between threads."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._idle: dict[Server, list[socket.socket]] = {}
        self._lock = threading.Lock()
        self._tls: ssl.SSLContext | None = None  # made at the first https server

    def get(self, url: str) -> Response:
        """Raises OSError (refused, reset, timed out: SlowAnswer once the answer had begun) or
        http.client.HTTPException (no HTTP answer; TooLarge for a body beyond MAX_BODY)."""
        deadline = time.monotonic() + self.timeout
        server, head = request(url)
        sock, reused = self._take(server)
        try:
            if sock is None:
                sock = self._connect(server, deadline)
            try:
                answer = get(sock, head, deadline)
            except (ConnectionError, http.client.RemoteDisconnected):
                if not reused:
                    raise
                sock.close()  # the server closed a kept-alive connection meanwhile: once more, afresh
                sock = self._connect(server, deadline)
                answer = get(sock, head, deadline)
        except BaseException:
            if sock is not None:
                sock.close()
            raise
        if answer.will_close:
            sock.close()
        else:
            with self._lock:
                self._idle.setdefault(server, []).append(sock)
        return Response(answer.status, answer.body)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for socks in idle.values():
            for sock in socks:
                sock.close()

    def _take(self, server: Server) -> tuple[socket.socket | None, bool]:
        with self._lock:
            idle = self._idle.get(server)
            if idle:
                return idle.pop(), True
        return None, False

    def _connect(self, server: Server, deadline: float) -> socket.socket:
        scheme, host, port = server
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        sock = socket.create_connection((host, port), left)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the GET goes out whole at once
            if scheme == "https":
                sock = self._context().wrap_socket(sock, server_hostname=host)
        except BaseException:
            sock.close()
            raise
        return sock

    def _context(self) -> ssl.SSLContext:
        if self._tls is None:  # as http.client's default: the system's CAs, the host name checked
            context = ssl.create_default_context()
            context.set_alpn_protocols(["http/1.1"])
            self._tls = context
        return self._tls


class WrongStatus(Wrong):
    """An HTTP error status other than 503: the route is not what this kind of engine serves."""

    def __init__(self, message: str, status_code: int):
        super().__init__(message)
        self.status_code = status_code


def fetch(client: HttpClient, url: str) -> Response:
    """GET url; raises Unreachable, Loading (503) or WrongStatus instead of returning a failure."""
    try:
        response = client.get(url)
    except SlowAnswer as e:  # up, but too slow: counted, as no engine serving its routes answers so
        raise Unreachable(f"{url}: answer not complete within {client.timeout:g} s ({e})", counted=True) from e
    except TimeoutError as e:
        raise Unreachable(f"{url}: no answer within {client.timeout:g} s") from e
    except TooLarge as e:
        raise Wrong(f"{url}: {e}") from e
    except (OSError, http.client.RemoteDisconnected, http.client.IncompleteRead) as e:  # refused, reset
        raise Unreachable(f"{url}: {type(e).__name__}: {e}") from e
    except http.client.HTTPException as e:  # something answered, not in HTTP
        raise Wrong(f"{url}: no HTTP answer ({type(e).__name__}: {e})") from e
    if response.status_code == 503:
        raise Loading(f"{url}: 503 {_not_ready_reason(response)}".rstrip())
    if response.status_code in _GATEWAY:
        raise Unreachable(f"{url}: {response.status_code} from a proxy in between")
    if response.status_code >= 400:
        raise WrongStatus(f"{url}: HTTP {response.status_code}", response.status_code)
    return response


def _not_ready_reason(response: Response) -> str:
    """The worker's 503 bodies: /health {"status": "loading"}, others {"error": {"code": "model_loading"}}."""
    try:
        body = response.json()
    except ValueError:
        return ""
    if not isinstance(body, dict):
        return ""
    error = body.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    return str(body.get("status") or code or "")
