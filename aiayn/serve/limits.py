"""What one request may hold, and how a request that breaks a rule is answered: a status and one line.

| rule | answer |
| --- | --- |
| headers larger than `max_header_bytes` | 431 (the connection closes) |
| headers not all sent within `read_seconds` | 408 (the connection closes) |
| body larger than `max_body_bytes` | 413 |
| body not all sent within `read_seconds` of its first read | 408 |
| the client closes the connection before its whole body is sent | 499 (in `/metrics`; one log line) |
| more than `max_connections` connections open | 503 (the connection closes) |
| more than `max_texts` texts, or a text longer than `max_chars` characters | 413 |
| the model's queue already holds `max_queue` texts | 429 (retry later) |
| a body that is not JSON (or form data), or nests deeper than Python's recursion limit | 400 |
| a field missing or of the wrong type, a text the model cannot take | 422 |
| a model or language pair the server does not have | 404 |
| no API key, a Host not this machine's, a page of another origin | 401, 400, 403 (aiayn/serve/guard.py) |

The bounds on headers and connections are kept by the server's protocol (aiayn/serve/connections.py).

Every error answer is JSON, `{"error": "..."}` (LibreTranslate's shape), naming the problem and the fix.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote_plus

from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect, Request

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """Bounds on requests and connections; the defaults suit sentences and short paragraphs.

    `max_header_bytes` is nginx's default bound on a request's headers (4 buffers of 8 KiB), and
    `max_connections` is TEI's `--max-concurrent-requests` and nginx's `worker_connections` (512).
    """

    max_body_bytes: int = 1 << 20
    max_texts: int = 128
    max_chars: int = 5000
    max_queue: int = 1024
    max_header_bytes: int = 32 * 1024
    max_connections: int = 512
    read_seconds: float = 30.0

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_texts", "max_chars", "max_queue", "max_header_bytes", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not (math.isfinite(self.read_seconds) and self.read_seconds > 0):
            raise ValueError(f"read_seconds must be a positive number, got {self.read_seconds}")


class ApiError(Exception):
    """A request the server refuses: the HTTP status and one line saying why."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class Stopped(ApiError):
    """A request the stopping server did not answer (its drain time ran out, or a second signal came): 503."""

    def __init__(self):
        super().__init__(503, "the server stopped before answering this request; send it again when the server is "
                              "back")


class WorkerLost(ApiError):
    """A request whose worker process died or stopped answering under it (it is replaced): 503, retry."""

    def __init__(self, worker: str):
        super().__init__(503, f"the worker process running this {worker}; it was replaced, retry the request")


async def read_body(request: Request, limits: Limits) -> bytes:
    """The request's body, refused with 413 as soon as it passes `max_body_bytes` (declared or sent), with 408 when
    it has not all come within `read_seconds`, and with 499 (logged in one line) when the client goes away first."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise ApiError(413, f"the body has {declared} bytes, more than the limit of {limits.max_body_bytes}")
    body = bytearray()
    loop = asyncio.get_running_loop()
    deadline, chunks = loop.time() + limits.read_seconds, request.stream()
    try:
        while True:
            try:
                chunk = await asyncio.wait_for(chunks.__anext__(), deadline - loop.time())
            except StopAsyncIteration:
                break
            body += chunk
            if len(body) > limits.max_body_bytes:
                raise ApiError(413, f"the body has more than the limit of {limits.max_body_bytes} bytes")
    except asyncio.TimeoutError:
        raise ApiError(408, f"the body did not all arrive within {limits.read_seconds:g} s ({len(body)} bytes came); "
                            "send it at once") from None
    except ClientDisconnect:
        logger.warning("%s %s: the client closed the connection before sending its whole body (%d bytes came)",
                       request.method, request.url.path, len(body))
        raise ApiError(499, "the client closed the connection") from None
    return bytes(body)


async def read_fields(request: Request, limits: Limits, *, form: bool = False) -> dict[str, Any]:
    """The request's JSON object, or (when `form`) its form fields; a field given twice becomes a list."""
    body = await read_body(request, limits)
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if form and kind in ("application/x-www-form-urlencoded", "multipart/form-data"):
        pairs = urlencoded_fields(body) if kind.startswith("application") else await multipart_fields(request, body)
        named: dict[str, list] = {}
        for key, value in pairs:
            named.setdefault(key, []).append(value)
        return {key: (values[0] if len(values) == 1 else values) for key, values in named.items()}
    try:
        fields = json.loads(body)
    except (ValueError, UnicodeDecodeError) as err:
        accepted = "JSON or form data" if form else "JSON"
        raise ApiError(400, f"the body is not valid {accepted}: {err}") from None
    except RecursionError:
        raise ApiError(400, "the body's JSON nests too deeply to read; send a flatter object") from None
    if not isinstance(fields, dict):
        raise ApiError(422, f"the body must be a JSON object, got {type(fields).__name__}")
    return fields


def _not_utf8(name: str, err: UnicodeDecodeError) -> ApiError:
    return ApiError(400, f"the form field {name!r} is not UTF-8 text (byte {err.object[err.start]:#04x} at "
                         f"{err.start}); send the form in UTF-8")


def urlencoded_fields(body: bytes) -> list[tuple[str, str]]:
    """The (name, value) pairs of an `application/x-www-form-urlencoded` body, in order: both UTF-8, as raw bytes or
    percent-escaped (starlette reads raw bytes as Latin-1, making "café" "cafÃ©", and escapes with replacement
    characters; here either is refused, naming the field)."""
    pairs = []
    for piece in body.split(b"&"):
        if not piece:
            continue
        raw_name, _, raw_value = piece.partition(b"=")
        name = unquote_plus(raw_name.decode("utf-8", "replace"))
        try:
            pairs.append((unquote_plus(raw_name.decode("utf-8"), errors="strict"),
                          unquote_plus(raw_value.decode("utf-8"), errors="strict")))
        except UnicodeDecodeError as err:
            raise _not_utf8(name, err) from None
    return pairs


class _StrictMultiPart(MultiPartParser):
    """starlette's multipart parser, refusing what it lets by: a field that is not text in the body's charset (it
    falls back to Latin-1) and a body cut before its closing boundary (it keeps the parts before)."""

    ended = False

    def on_part_end(self) -> None:
        part = self._current_part
        if part.file is None:
            try:
                bytes(part.data).decode(self._charset)
            except UnicodeDecodeError as err:
                raise _not_utf8(part.field_name, err) from None
        super().on_part_end()

    def on_end(self) -> None:
        self.ended = True
        super().on_end()


async def multipart_fields(request: Request, body: bytes) -> list[tuple[str, Any]]:
    """The (name, value) pairs of a `multipart/form-data` body, in order (a file's value is starlette's
    `UploadFile`), or 400 naming what is wrong with it."""
    async def replay():
        yield body

    parser = _StrictMultiPart(request.headers, replay())
    try:
        form = await parser.parse()
    except MultiPartException as err:
        raise ApiError(400, f"the body is not valid form data: {err}") from None
    if not parser.ended:
        raise ApiError(400, "the body is not valid form data: its multipart parts do not end with the closing "
                            "boundary the Content-Type names")
    return list(form.multi_items())


def texts_field(fields: dict[str, Any], name: str, limits: Limits) -> tuple[list[str], bool]:
    """The texts of field `name` (a string or a list of strings) and whether it was one string."""
    if name not in fields:
        raise ApiError(422, f"the field {name!r} is missing: give a string or a list of strings")
    value = fields[name]
    single = isinstance(value, str)
    texts = [value] if single else value
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        kind = type(value).__name__ if not isinstance(value, list) else "a list holding a non-string"
        raise ApiError(422, f"the field {name!r} must be a string or a list of strings, got {kind}")
    if not texts:
        raise ApiError(422, f"the field {name!r} is an empty list: give at least one text")
    if len(texts) > limits.max_texts:
        raise ApiError(413, f"{len(texts)} texts in one request, more than the limit of {limits.max_texts}; "
                            "split them over several requests")
    for number, text in enumerate(texts):
        if len(text) > limits.max_chars:
            raise ApiError(413, f"text {number} has {len(text)} characters, more than the limit of "
                                f"{limits.max_chars}")
        if not text.isascii():  # JSON may escape half a surrogate pair ("\ud800"): no Unicode text, no tokens
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as err:
                raise ApiError(422, f"text {number} holds a lone surrogate ({text[err.start]!a}) at character "
                                    f"{err.start}: it is not Unicode text; send the whole pair, or the "
                                    "character itself") from None
    return texts, single


def bool_field(fields: dict[str, Any], name: str, default: bool = False) -> bool:
    """An optional true/false field (null: the default); 422 for anything else."""
    value = fields.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(422, f"the field {name!r} must be true or false, got {value!r}")
    return value


def string_field(fields: dict[str, Any], name: str, default: str | None = None,
                 choices: tuple[str, ...] = ()) -> str | None:
    """An optional string field, one of `choices` when they are given."""
    value = fields.get(name, default)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ApiError(422, f"the field {name!r} must be a string, got {type(value).__name__}")
    if choices and value not in choices:
        raise ApiError(422, f"the field {name!r} must be one of {', '.join(choices)}, got {value!r}")
    return value
