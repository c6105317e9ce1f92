"""One HTTP/1.1 GET on a socket and its answer, read under one deadline: the exporter's whole use of HTTP.

Every engine is read on every scrape, about a hundred GETs per scrape on a node of 64 engines, so a GET's
own CPU counts: http.client parses each answer's headers through the email package and wraps its socket
in three file objects, several times the work of the GET itself. Here the request is built once per URL
and the answer read with a bytearray: its status line, the few headers that frame its body
(Content-Length, Transfer-Encoding, Connection), and its body, bounded.

Failures raise http.client's exceptions, as http.client raises them for the same bytes (limits on lines and
headers included), so that fetch.py sorts each into the same state: RemoteDisconnected for a server that
closed without answering, BadStatusLine and the other HTTPExceptions for an answer not in HTTP,
IncompleteRead for a body cut short; TimeoutError (SlowAnswer once the answer had begun) past the deadline.
"""
from __future__ import annotations

import re
import socket
import time
from dataclasses import dataclass
from functools import lru_cache
from http.client import (
    BadStatusLine,
    HTTPException,
    IncompleteRead,
    InvalidURL,
    LineTooLong,
    RemoteDisconnected,
    UnknownProtocol,
)
from urllib.parse import urlsplit

MAX_LINE, MAX_HEADERS = 65536, 100  # http.client's bounds on a line and on the lines of a header block
# The largest answer read: a vLLM /metrics is about 60 KB, a ledger a few KB; a bigger body is wrong.
MAX_BODY = 8 << 20
RECEIVE = 8 << 10  # bytes asked of the socket at a time: as http.client's buffer (64 KB, held by 64 reading threads, grew the exporter by 15 MiB)
_NO_URL_CHARACTER = re.compile("[\x00-\x20\x7f]")
_HEADER_NAME = re.compile(rb"[\x21-\x39\x3b-\x7e]*:")  # the email package's: a header name, then a colon
_PLAIN_BLOCK = re.compile(rb"(?:[\x21-\x39\x3b-\x7e]*:[^\r\n]*\r\n)+")
# The headers that frame a body, each value as the email package gives it (leading blanks taken off).
_FRAMING = re.compile(rb"^(content-length|transfer-encoding|connection|keep-alive|proxy-connection):[ \t]*(.*?)\r$",
                      re.IGNORECASE | re.MULTILINE)


class SlowAnswer(TimeoutError):
    """The deadline passed after the server had begun to answer: up, but too slow (or dripping)."""


class TooLarge(HTTPException):
    """A body beyond MAX_BODY."""


Server = tuple[str, str, int]  # scheme, host, port


@lru_cache(maxsize=1024)
def request(url: str) -> tuple[Server, bytes]:
    """The server a URL names and the bytes of its GET, built once per URL; raises InvalidURL for a URL
    no request line can carry."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    default = 443 if parts.scheme == "https" else 80
    port = parts.port or default
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    for text in (host, target):
        if found := _NO_URL_CHARACTER.search(text):
            raise InvalidURL(f"URL can't contain control characters. {text!r} (found at least {found.group()!r})")
    try:
        named = host.encode("ascii")
    except UnicodeEncodeError:
        named = host.encode("idna")
    if b":" in named:  # an IPv6 address
        named = b"[" + named + b"]"
    if port != default:
        named += b":%d" % port
    head = b"GET " + target.encode("ascii") + b" HTTP/1.1\r\nHost: " + named + b"\r\nAccept-Encoding: identity\r\n\r\n"
    return (parts.scheme, host, port), head


@dataclass(frozen=True)
class Answer:
    """A whole answer: its status, its body, and whether the server closes the connection after it."""
    status: int
    body: bytes
    will_close: bool


class _Receiver:
    """The socket's bytes of one answer, each receive given only what is left of the deadline."""

    def __init__(self, sock: socket.socket, deadline: float):
        self._sock, self._deadline = sock, deadline
        self._buf = bytearray()
        self._at = 0  # the first byte of _buf not yet taken
        self.received = 0

    def _more(self) -> bool:
        """Receives what the server sends next; False at the end of the connection."""
        left = self._deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError("timed out")
            self._sock.settimeout(left)
            data = self._sock.recv(RECEIVE)
        except TimeoutError as e:
            if self.received:
                raise SlowAnswer(f"{self.received} bytes of the answer arrived in time") from e
            raise
        self.received += len(data)
        self._buf += data
        return bool(data)

    def _take(self, end: int) -> bytes:
        with memoryview(self._buf) as view:  # copied once, not sliced into a bytearray first
            taken = bytes(view[self._at:end])
        self._at = end
        return taken

    def line(self) -> bytes:
        """The next line, its newline included; MAX_LINE + 1 bytes where it is longer; b"" at the end."""
        while True:
            end = self._buf.find(b"\n", self._at, self._at + MAX_LINE + 1)
            if end >= 0:
                return self._take(end + 1)
            if len(self._buf) - self._at > MAX_LINE:
                return self._take(self._at + MAX_LINE + 1)
            if not self._more():
                return self._take(len(self._buf))

    def plain_header_block(self) -> bytes | None:
        """The header block, as it mostly comes: whole in the buffer, short, each line a "name: value"
        ended by CRLF; None (nothing taken) for any other, which header_lines() reads line by line."""
        end = self._buf.find(b"\r\n\r\n", self._at)
        if end < 0 or end + 2 - self._at > MAX_LINE:
            return None
        block = self._buf[self._at:end + 2]
        if block.count(b"\n") >= MAX_HEADERS or not _PLAIN_BLOCK.fullmatch(block):
            return None
        self._at = end + 4
        return bytes(block)

    def header_lines(self) -> list[bytes]:
        """The lines of a header block, without the blank line that ends it (or the connection's end)."""
        lines: list[bytes] = []
        while True:
            line = self.line()
            if len(line) > MAX_LINE:
                raise LineTooLong("header line")
            if len(lines) == MAX_HEADERS:
                raise HTTPException(f"got more than {MAX_HEADERS} headers")
            if line in (b"\r\n", b"\n", b""):
                return lines
            lines.append(line)

    def exactly(self, size: int, body_so_far: int = 0) -> bytes:
        """The next size bytes; raises IncompleteRead where the connection ends first, TooLarge as soon as
        body_so_far and what has arrived pass MAX_BODY."""
        while len(self._buf) - self._at < size:
            if body_so_far + len(self._buf) - self._at > MAX_BODY:
                raise TooLarge(f"body over {MAX_BODY} bytes")
            if not self._more():
                partial = self._take(len(self._buf))
                raise IncompleteRead(partial, size - len(partial))
        return self._take(self._at + size)

    def to_end(self) -> bytes:
        """Everything up to the end of the connection, bounded."""
        while self._more():
            if len(self._buf) - self._at > MAX_BODY:
                raise TooLarge(f"body over {MAX_BODY} bytes")
        return self._take(len(self._buf))


def get(sock: socket.socket, head: bytes, deadline: float) -> Answer:
    """Sends one GET (head, from request()) and reads its whole answer, all within the deadline."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    sock.settimeout(left)
    sock.sendall(head)
    return read_answer(_Receiver(sock, deadline))


def read_answer(receiver: _Receiver) -> Answer:
    """The answer the receiver's bytes carry, framed as http.client frames it."""
    while True:  # a 100 Continue comes before the answer
        status, version = _status_line(receiver.line())
        if status != 100:
            break
        _headers(receiver)
    headers = _headers(receiver)
    chunked = headers.get(b"transfer-encoding", b"").lower() == b"chunked"
    will_close = _closes(version, headers)
    length = None if chunked else _length(headers.get(b"content-length"))
    if status in (204, 304) or 100 <= status < 200:
        length = 0
    if chunked:  # whatever the status: its chunks frame it
        return Answer(status, _chunks(receiver), will_close)
    if length is not None:
        if length > MAX_BODY:
            raise TooLarge(f"body over {MAX_BODY} bytes ({length} said)")
        return Answer(status, receiver.exactly(length), will_close)
    return Answer(status, receiver.to_end(), True)  # its end is the connection's


def _status_line(raw: bytes) -> tuple[int, int]:
    """(status, 10 or 11 for HTTP/1.0 or 1.x) of a status line."""
    if len(raw) > MAX_LINE:
        raise LineTooLong("status line")
    if not raw:
        raise RemoteDisconnected("Remote end closed connection without response")
    line = raw.decode("iso-8859-1")
    words = line.split(None, 2)
    if len(words) < 2 or not words[0].startswith("HTTP/"):
        raise BadStatusLine(line)
    try:
        status = int(words[1])
    except ValueError:
        raise BadStatusLine(line) from None
    if not 100 <= status <= 999:
        raise BadStatusLine(line)
    if words[0] in ("HTTP/1.0", "HTTP/0.9"):
        return status, 10
    if not words[0].startswith("HTTP/1."):
        raise UnknownProtocol(words[0])
    return status, 11


def _headers(receiver: _Receiver) -> dict[bytes, bytes]:
    """The header block, its names lowercased, each name's first value. As the email package reads it: a
    line beginning with a space continues the header above, and a line that is no header ends the headers
    (what follows it up to the blank line is not read as headers)."""
    block = receiver.plain_header_block()
    if block is not None:  # every line a header: the first value of each header read
        return {name.lower(): value for name, value in reversed(_FRAMING.findall(block))}
    found: dict[bytes, bytes] = {}
    name = None  # the header a continuation line belongs to; None for one whose value is not read
    for line in receiver.header_lines():
        if line[:1] in (b" ", b"\t"):
            if name is not None:
                found[name] += line
            continue
        if line.startswith(b"From "):  # an envelope line, no header
            continue
        match = _HEADER_NAME.match(line)
        if match is None:
            break
        key = match.group()[:-1].lower()
        name = None if key in found else key  # later values of a name are not read
        if name is not None:
            found[name] = line[match.end():].lstrip(b" \t")
    return {key: value.rstrip(b"\r\n") for key, value in found.items()}


def _closes(version: int, headers: dict[bytes, bytes]) -> bool:
    connection = headers.get(b"connection", b"").lower()
    if version == 11:
        return b"close" in connection
    keep = headers.get(b"keep-alive") or b"keep-alive" in connection \
        or b"keep-alive" in headers.get(b"proxy-connection", b"").lower()
    return not keep


def _length(value: bytes | None) -> int | None:
    """Content-Length; None where it is absent, no number, or negative."""
    if not value:
        return None
    try:
        length = int(value)
    except ValueError:
        return None
    return length if length >= 0 else None


def _chunks(receiver: _Receiver) -> bytes:
    """A chunked body, its chunks joined, bounded."""
    body = bytearray()
    while True:
        line = receiver.line()
        if len(line) > MAX_LINE:
            raise LineTooLong("chunk size")
        try:
            size = int(line.split(b";", 1)[0], 16)
        except ValueError:
            raise IncompleteRead(bytes(body)) from None
        if size < 0:
            raise IncompleteRead(bytes(body))
        if size == 0:
            break
        body += receiver.exactly(size, len(body))
        if len(body) > MAX_BODY:
            raise TooLarge(f"body over {MAX_BODY} bytes")
        receiver.exactly(2)  # the chunk's CRLF
    while (trailer := receiver.line()) not in (b"\r\n", b"\n", b""):
        if len(trailer) > MAX_LINE:
            raise LineTooLong("trailer line")
    return bytes(body)
