"""One GET of an engine's route, its failure sorted into a lifecycle state (exporter/engines/base.py)."""
from __future__ import annotations

import httpx

from exporter.engines.base import Loading, Unreachable, Wrong

# A proxy between the exporter and the engine answers these when the engine behind it is gone.
_GATEWAY = (502, 504)


class WrongStatus(Wrong):
    """An HTTP error status other than 503: the route is not what this kind of engine serves."""

    def __init__(self, message: str, status_code: int):
        super().__init__(message)
        self.status_code = status_code


def fetch(client: httpx.Client, url: str) -> httpx.Response:
    """GET url; raises Unreachable, Loading (503) or WrongStatus instead of returning a failure."""
    try:
        response = client.get(url)
    except httpx.TimeoutException as e:
        raise Unreachable(f"{url}: no answer within the timeout ({type(e).__name__})") from e
    except httpx.TransportError as e:  # refused, reset, no such host
        raise Unreachable(f"{url}: {type(e).__name__}: {e}") from e
    if response.status_code == 503:
        raise Loading(f"{url}: 503 {_not_ready_reason(response)}".rstrip())
    if response.status_code in _GATEWAY:
        raise Unreachable(f"{url}: {response.status_code} from a proxy in between")
    if response.is_error:
        raise WrongStatus(f"{url}: HTTP {response.status_code}", response.status_code)
    return response


def _not_ready_reason(response: httpx.Response) -> str:
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
