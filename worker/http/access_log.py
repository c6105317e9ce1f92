"""Probes stay out of the access log: Kubernetes asks GET /health every few seconds and Prometheus
scrapes GET /metrics, and a line for each buried the requests worth reading. `--log-probes` keeps them."""
from __future__ import annotations

import logging

PROBE_PATHS = frozenset({"/health", "/metrics"})


class ProbeFilter(logging.Filter):
    """Drops uvicorn's access line of a GET (or HEAD) of a probe path, whatever its status or query.

    uvicorn logs each request as '%s - "%s %s HTTP/%s" %d' with args (client, method, path with its
    query string, HTTP version, status) (uvicorn/protocols/http/h11_impl.py and httptools_impl.py)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) != 5:
            return True  # not an access line of that shape: kept
        method, path = args[1], str(args[2]).split("?", 1)[0]
        return not (method in ("GET", "HEAD") and path in PROBE_PATHS)


def quiet_probes() -> None:
    """Install the filter on uvicorn's access logger (after uvicorn.Config, which configures its logging)."""
    logging.getLogger("uvicorn.access").addFilter(ProbeFilter())
