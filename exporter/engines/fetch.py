"""GETs of the engines' routes over kept-alive connections, each failure sorted into a lifecycle state.

Every engine is read on every scrape, so a GET's own cost counts: http.client takes about a quarter
of the CPU httpx does per request, and this is all the exporter asks of HTTP (no proxies: a proxy
from the environment must not sit between the exporter and its engines).
"""
from __future__ import annotations

import http.client
import json
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

from exporter.engines.base import Loading, Unreachable, Wrong

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
    """GETs with one timeout (to connect, and for each read), reusing idle connections per server;
    safe to share between threads."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._idle: dict[tuple[str, str, int], list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()

    def get(self, url: str) -> Response:
        """Raises OSError (refused, reset, timed out) or http.client.HTTPException (no HTTP answer)."""
        parts = urlsplit(url)
        server = (parts.scheme, parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80))
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn, reused = self._take(server)
        try:
            try:
                response, body = self._get(conn, target)
            except (ConnectionError, http.client.RemoteDisconnected):
                if not reused:
                    raise
                conn.close()  # the server closed a kept-alive connection meanwhile: once more, afresh
                conn = self._connection(server)
                response, body = self._get(conn, target)
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
    def _get(conn: http.client.HTTPConnection, target: str) -> tuple[http.client.HTTPResponse, bytes]:
        conn.request("GET", target, headers={"Accept-Encoding": "identity"})
        response = conn.getresponse()
        return response, response.read()  # read whole: then the connection can serve the next GET

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


class WrongStatus(Wrong):
    """An HTTP error status other than 503: the route is not what this kind of engine serves."""

    def __init__(self, message: str, status_code: int):
        super().__init__(message)
        self.status_code = status_code


def fetch(client: HttpClient, url: str) -> Response:
    """GET url; raises Unreachable, Loading (503) or WrongStatus instead of returning a failure."""
    try:
        response = client.get(url)
    except TimeoutError as e:
        raise Unreachable(f"{url}: no answer within {client.timeout:g} s") from e
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
