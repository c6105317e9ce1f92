"""GETs of the engines' routes over kept-alive connections, each failure sorted into a lifecycle state.

Every engine is read on every scrape, so a GET's own cost counts: http.client takes about a quarter
of the CPU httpx does per request, and this is all the exporter asks of HTTP (no proxies: a proxy
from the environment must not sit between the exporter and its engines).

Each GET has one deadline for all of it (connect, send, status line, headers, body): a socket timeout
alone applies to each receive, so an engine answering a byte at a time would hold a read for as long
as it liked. And its body is bounded, so no engine can make the exporter hold more than MAX_BODY.
"""
from __future__ import annotations

import http.client
import io
import json
import socket
import threading
import time
from dataclasses import dataclass
from functools import partial
from urllib.parse import urlsplit

from vramledger.exporter.engines.base import Loading, Unreachable, Wrong

# A proxy between the exporter and the engine answers these when the engine behind it is gone.
_GATEWAY = (502, 504)
# The largest answer read: a vLLM /metrics is about 60 KB, a ledger a few KB; a bigger body is wrong.
MAX_BODY = 8 << 20
_PIECE = 64 << 10  # a body of unknown length is read this much at a time


class SlowAnswer(TimeoutError):
    """The deadline passed after the server had begun to answer: up, but too slow (or dripping)."""


class TooLarge(http.client.HTTPException):
    """A body beyond MAX_BODY."""


class _DeadlineIO(io.RawIOBase):
    """The response's socket reader, each receive given only what is left of the GET's deadline."""

    def __init__(self, raw: io.RawIOBase, sock: socket.socket, deadline: float):
        super().__init__()
        self._raw, self._sock, self._deadline = raw, sock, deadline
        self.received = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self._deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError("timed out")
            self._sock.settimeout(left)
            n = self._raw.readinto(buffer) or 0
        except TimeoutError as e:
            if self.received:
                raise SlowAnswer(f"{self.received} bytes of the answer arrived in time") from e
            raise
        self.received += n
        return n

    def close(self) -> None:
        super().close()
        self._raw.close()  # the socket's reference: the connection closes the socket itself


class _DeadlineResponse(http.client.HTTPResponse):
    """http.client's response, reading its status line, headers and body under one deadline."""

    def __init__(self, sock: socket.socket, *args, deadline: float, **kwargs):
        super().__init__(sock, *args, **kwargs)
        # http.client's reader, unbuffered: it keeps the socket open while the response reads
        raw = self.fp.detach()
        self.fp = io.BufferedReader(_DeadlineIO(raw, sock, deadline))


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
        self._idle: dict[tuple[str, str, int], list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()

    def get(self, url: str) -> Response:
        """Raises OSError (refused, reset, timed out: SlowAnswer once the answer had begun) or
        http.client.HTTPException (no HTTP answer; TooLarge for a body beyond MAX_BODY)."""
        deadline = time.monotonic() + self.timeout
        parts = urlsplit(url)
        server = (parts.scheme, parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80))
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn, reused = self._take(server)
        try:
            try:
                response, body = self._get(conn, target, deadline)
            except (ConnectionError, http.client.RemoteDisconnected):
                if not reused:
                    raise
                conn.close()  # the server closed a kept-alive connection meanwhile: once more, afresh
                conn = self._connection(server)
                response, body = self._get(conn, target, deadline)
        except BaseException:
            conn.close()
            raise
        if response.will_close:
            conn.close()
        else:
            with self._lock:
                self._idle.setdefault(server, []).append(conn)
        return Response(response.status, body)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()

    @staticmethod
    def _get(conn: http.client.HTTPConnection, target: str,
             deadline: float) -> tuple[http.client.HTTPResponse, bytes]:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        conn.timeout = left  # to connect, where the connection is new
        if conn.sock is not None:
            conn.sock.settimeout(left)  # to send
        # One class for every connection, its deadline given per response.
        conn.response_class = partial(_DeadlineResponse, deadline=deadline)  # type: ignore[assignment]
        conn.request("GET", target, headers={"Accept-Encoding": "identity"})
        response = conn.getresponse()
        return response, _bounded_body(response)  # read whole: then the connection can serve the next GET

    def _take(self, server: tuple[str, str, int]) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            idle = self._idle.get(server)
            if idle:
                return idle.pop(), True
        return self._connection(server), False

    def _connection(self, server: tuple[str, str, int]) -> http.client.HTTPConnection:
        scheme, host, port = server
        kind = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
        return kind(host, port, timeout=self.timeout)


def _bounded_body(response: http.client.HTTPResponse) -> bytes:
    if response.length is not None:
        if response.length > MAX_BODY:
            raise TooLarge(f"body over {MAX_BODY} bytes ({response.length} said)")
        return response.read()
    body = bytearray()  # chunked, or up to the end of the connection: the bound is found while reading
    while piece := response.read(_PIECE):
        body += piece
        if len(body) > MAX_BODY:
            raise TooLarge(f"body over {MAX_BODY} bytes")
    return bytes(body)


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
