"""The HTTP server's settings, beside the engine's: read from the command line and the environment here only."""
from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass

API_KEY_ENV = "VRAMLEDGER_API_KEY"  # the key without putting it on the command line
METRICS_ENV = "VRAMLEDGER_METRICS"  # "off": no request metrics and no /metrics (to measure their cost)
METRICS_AUTH_ENV = "VRAMLEDGER_METRICS_AUTH"  # "1": /metrics needs the API key too
# After SIGTERM the process exits at most this long (seconds) after the drain timeout: the aborted
# requests' last chunks, the HTTP server's own shutdown, then the engine thread's last step.
ABORT_GRACE = 5.0
HTTP_SHUTDOWN_GRACE = 5
ENGINE_STOP_GRACE = 5.0
SHUTDOWN_MARGIN = ABORT_GRACE + HTTP_SHUTDOWN_GRACE + ENGINE_STOP_GRACE


@dataclass
class ServerSettings:
    """HTTP settings beside the engine's: auth, admission and limits."""

    api_key: str | None = None
    max_waiting: int = 256
    metrics: bool = True
    protect_metrics: bool = False  # /health and /metrics are open unless this is set
    max_body_bytes: int = 4 << 20  # a long prompt is well under this; a 413 beats parsing a flood
    served_model_name: str | None = None
    drain_timeout: float = 30.0  # seconds running requests get after SIGTERM (worker/http/drain.py)
    # Bounded intake (intake.py, body_slots.py), in seconds: a connection with no request in progress,
    # a request's headers from its first byte, its body from the first read (and a wait for a slot).
    keep_alive_timeout: float = 5.0  # uvicorn's default
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_receiving_bodies: int = 8  # bodies read and not yet parsed at once: the ledger's `server` holds them

    def __post_init__(self):
        if self.max_waiting < 1:
            raise ValueError("--max-waiting must be >= 1")
        if self.max_receiving_bodies < 1:
            raise ValueError("--max-receiving-bodies must be >= 1")
        if min(self.keep_alive_timeout, self.header_timeout, self.body_timeout) <= 0:
            raise ValueError("--keep-alive-timeout, --header-timeout and --body-timeout must be > 0")

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> ServerSettings:
        """The settings of `python -m vramledger.worker serve`: its flags and the VRAMLEDGER_* variables (--api-key
        wins over VRAMLEDGER_API_KEY)."""
        return cls(api_key=args.api_key or environ.get(API_KEY_ENV) or None,
                   max_waiting=args.max_waiting,
                   metrics=environ.get(METRICS_ENV, "on").lower() not in ("off", "0", "false"),
                   protect_metrics=environ.get(METRICS_AUTH_ENV, "") == "1",
                   served_model_name=args.served_model_name,
                   drain_timeout=args.drain_timeout, keep_alive_timeout=args.keep_alive_timeout,
                   header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                   max_receiving_bodies=args.max_receiving_bodies)
