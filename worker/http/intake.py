"""Connection deadlines uvicorn's HTTP protocol lacks, and a body read only when the app asks for it.

uvicorn times an idle connection out only after a response: one that never sends a byte, or that
trickles a request's headers a line at a time (slowloris), is held until the client leaves. Here a
connection with no request in progress is closed after the keep-alive timeout from its start too,
and a request's headers must be complete within the header timeout of its first byte (else a 408
and the connection closed). A request's body is read only while the app waits for it: a request
waiting for a body slot (body_slots.py) leaves what it has not sent with its headers in the kernel's
socket buffer, not in the process. And a connection lost while a pipelined request runs marks that
request's client gone, as uvicorn does only for the last request it parsed: the request is aborted
instead of writing its answer to a closed transport (an ERROR traceback per request).
"""
from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.auto import AutoHTTPProtocol

log = logging.getLogger(__name__)
TOO_SLOW = b"the request's headers took too long to arrive"
REQUEST_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                   b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(TOO_SLOW), TOO_SLOW))
# Seconds a connection closed with a 408 still reads, and drops, what its client sends after the
# answer: a socket closed with unread data resets the connection, and the reset can destroy the 408
# before the client has read it (a lingering close, as web servers do).
LINGER = 2.0


def intake_protocol(keep_alive_timeout: float, header_timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's protocol (httptools where installed, else h11) with the two deadlines."""

    class IntakeProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]  # a class chosen at import
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.timeout_keep_alive = keep_alive_timeout  # uvicorn's, after each response
            self.header_deadline: asyncio.TimerHandle | None = None
            self.lingering = False
            self.timeout_keep_alive_task = self.loop.call_later(keep_alive_timeout, self.timeout_keep_alive_handler)

        def data_received(self, data: bytes) -> None:
            if self.lingering:  # answered and closing: what the client still sends is dropped
                return
            if self.between_requests() and self.header_deadline is None:  # a request's first bytes
                self.header_deadline = self.loop.call_later(header_timeout, self.headers_too_slow)
            super().data_received(data)
            if not self.between_requests():  # its headers are complete
                self.cancel_header_deadline()
                if self.cycle.more_body:  # the rest is read as the app receives it
                    self.flow.pause_reading()

        def _start_asgi_task(self, cycle, app) -> None:  # httptools' (h11's runs no pipelined requests)
            self.started_cycle = cycle
            super()._start_asgi_task(cycle, app)

        def connection_lost(self, exc) -> None:
            self.cancel_header_deadline()
            started = getattr(self, "started_cycle", None)
            if started is not None and not started.response_complete:  # uvicorn tells self.cycle only
                started.disconnected = True
                started.message_event.set()
            super().connection_lost(exc)

        def between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def cancel_header_deadline(self) -> None:
            if self.header_deadline is not None:
                self.header_deadline.cancel()
                self.header_deadline = None

        def headers_too_slow(self) -> None:
            self.header_deadline = None
            if self.between_requests() and not self.transport.is_closing():
                log.info("closed a connection from %s: its request's headers took more than %g s",
                         peer(self.client), header_timeout)
                self.transport.write(REQUEST_TIMEOUT)
                self.close_lingering()

        def close_lingering(self) -> None:
            """Sends the end of the answer (a FIN after it), reads on for LINGER seconds, then closes."""
            self.lingering = True
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(LINGER, self.transport.close)

    return IntakeProtocol


def peer(client) -> str:
    """host:port of a connection's client (uvicorn's `client`, an ASGI scope's)."""
    return "%s:%d" % tuple(client) if client else "an unknown client"
