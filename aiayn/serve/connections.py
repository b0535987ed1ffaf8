"""What uvicorn leaves unbounded on a connection, bounded: the headers' size, the time to send them, open connections.

uvicorn with httptools (the stack `aiayn serve` runs on) reads headers of any size, waits for them for as long as a
client takes, and keeps every connection it accepts. `BoundedProtocol` is its httptools protocol with the bounds
nginx has by default:

| what | bound (`Limits`) | answer |
| --- | --- | --- |
| a request's headers (request line included) | `max_header_bytes` (32 KiB) | 431, then the connection closes |
| time from a connection's start (or a request's first byte) to its last header | `read_seconds` (30) | 408, closes |
| time for the rest of a body the answer did not wait for | `read_seconds` | the connection closes |
| connections open at once | `max_connections` (512) | 503, closes |

A client that shuts its sending side (a TCP half-close: `shutdown(SHUT_WR)`, `nc -N`) is taken as gone, as hyper
(TEI's server) takes it by default: TCP cannot tell it from a client that closed and left, and a client that left
frees its place in the queue. A connection that sends nothing is closed after `read_seconds`, without an answer;
between requests, uvicorn's keep-alive timeout (5 s) applies. The body's own deadline is `read_body`'s
(aiayn/serve/limits.py), so that its 408 goes through the application like every other answer. The header bound
holds for headers sent in one piece (counted as the parser reads them) as for headers that trickle in (counted as
they arrive). `DrainingServer` drains on SIGHUP and SIGQUIT as uvicorn does on SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import Iterator

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from aiayn.interrupts import handling
from aiayn.serve.limits import Limits

LINGER_S = 2.0  # how long a refused connection reads and drops what the client still sends before it closes


class BoundedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, bounding the headers' bytes and time and the connections open (`limits`)."""

    limits = Limits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None  # runs while a request's headers are read
        self._unread: asyncio.TimerHandle | None = None  # runs while a body no one reads is still coming
        self._header_bytes, self._parsed_bytes, self._heard = 0, 0, False
        self._refused = False  # answered by `_refuse`: nothing more of this connection reaches the application
        self._deferred: tuple[int, str] | None = None  # a refusal that waits for the answer before it
        self._answered = False  # the refusal is written: the connection only lingers until it closes
        if len(self.connections) > self.limits.max_connections:
            self._refuse(503, f"the server has {self.limits.max_connections} connections open, its limit "
                              "(--max-connections); retry later")
            return
        self._start_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        if self._unread is not None:
            self._unread.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._answered:  # refused and answered: what still comes is dropped until the connection closes
            return
        reading_headers = self._deadline is not None  # (the clock runs while a request's headers are read)
        super().data_received(data)
        if reading_headers and self._deadline is not None and not self.transport.is_closing():
            self._header_bytes += len(data)
            if self._header_bytes > self.limits.max_header_bytes:
                self._refuse(431, f"the request's headers pass the limit of {self.limits.max_header_bytes} bytes; "
                                  "send fewer or shorter headers (cookies included)")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes, self._parsed_bytes, self._heard = 0, 0, True
        if self._deadline is None:
            self._start_reading()

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._count_parsed(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        self._count_parsed(len(name) + len(value) + 4)  # "name: value\r\n"

    def _count_parsed(self, size: int) -> None:
        """The header bound for headers that come in one piece (`data_received` counts those that trickle in)."""
        self._parsed_bytes += size
        if self._parsed_bytes > self.limits.max_header_bytes and not self._refused:
            self._refuse(431, f"the request's headers pass the limit of {self.limits.max_header_bytes} bytes; "
                              "send fewer or shorter headers (cookies included)")

    def on_headers_complete(self) -> None:
        self._cancel_deadline()
        if not self._refused:
            super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        super().on_message_complete()
        self._heard = False
        if self._unread is not None:
            self._unread.cancel()
            self._unread = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._deferred is not None:
            refusal, self._deferred = self._deferred, None
            self._refuse(*refusal)
            return
        if self.cycle is not None and self.cycle.more_body and not self.transport.is_closing():
            # answered before its body was all sent (an unknown route, say): the rest gets `read_seconds` to come
            self._unread = self.loop.call_later(self.limits.read_seconds, self.transport.close)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request its parser refuses, in the server's JSON shape."""
        self._refuse(400, "not a valid HTTP/1.1 request: check its request line, headers and body framing")

    def _start_reading(self) -> None:
        self._deadline = self.loop.call_later(self.limits.read_seconds, self._too_slow)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if self._heard:
            self._refuse(408, f"the request's headers did not all arrive within {self.limits.read_seconds:g} s")
        else:  # nothing sent at all: nothing to answer
            self.transport.close()

    def _refuse(self, status: int, message: str) -> None:
        """Answer `status` with `{"error": message}` and close the connection; after the answer to an earlier request
        on it (pipelined) where that is still to come."""
        self._cancel_deadline()
        self._refused = True
        if self.transport.is_closing() or self._answered:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._deferred = (status, message)  # (written by `on_response_complete`)
            self.flow.pause_reading()
            return
        body = json.dumps({"error": message}).encode()
        reason = {400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large",
                  503: "Service Unavailable"}[status]
        head = [f"HTTP/1.1 {status} {reason}".encode()]
        head += [name + b": " + value for name, value in self.server_state.default_headers]
        head += [b"content-type: application/json", b"content-length: %d" % len(body), b"connection: close"]
        self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
        self._answered = True
        # Closed with the client's data unread, the kernel would reset the connection and the client could lose the
        # answer: send it and the end of this side, drop what still comes, close when the client does or at LINGER_S
        # (nginx's lingering close).
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()


def server_config(app, *, drain_seconds: float = 30.0, log_level: str = "warning") -> uvicorn.Config:
    """uvicorn's settings for `app` (from `create_app`): its `Limits` bound the connections (`BoundedProtocol`)."""
    protocol = type("BoundedProtocol", (BoundedProtocol,), {"limits": app.state.limits})
    return uvicorn.Config(app, http=protocol, log_level=log_level, timeout_graceful_shutdown=drain_seconds,
                          lifespan="on")


# Signals that stop a server as SIGTERM does (drain the requests in flight, then stop): uvicorn itself takes SIGINT
# and SIGTERM; a terminal's hang-up and Ctrl-\ would otherwise end every request in flight with a plain 500.
DRAINING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGHUP", "SIGQUIT") if hasattr(signal, name))


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which drains on SIGHUP and SIGQUIT as on SIGTERM (a signal ignored at start stays ignored),
    and closes the application after a second signal as after the first."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals(), handling(DRAINING_SIGNALS, self.handle_exit):
            yield

    async def shutdown(self, sockets=None) -> None:
        """uvicorn's shutdown; after a second signal too, the application's own shutdown runs (it closes the models'
        batchers and worker processes), where uvicorn would leave it to be cancelled with a traceback."""
        await super().shutdown(sockets)
        if self.force_exit:
            await self.lifespan.shutdown()

