"""Who may call the server: an API key, the Host names it answers to, and the web pages allowed to call it.

- The API key (`Access.api_key`), on every request but `GET /health` and the page at `/`: `Authorization:
  Bearer KEY` (OpenAI's and TEI's clients), or an `api_key` field in the body or the query (LibreTranslate's).
  Without it: 401.
- The Host header, on every request: a localhost name, an IP address, or one of `allowed_hosts` (the CLI adds
  the name it listens on). Another: 400.
- The calling page's origin, on every request but GET and HEAD: a browser's `Origin` (or, without one,
  `Sec-Fetch-Site: cross-site / same-site`) naming another origin than the server's, not in `cors_origins`: 403.

The Host check is what defeats DNS rebinding: a page on `evil.example` whose name the attacker points at 127.0.0.1
reaches the server with `Host: evil.example`. An IP address cannot be rebound, so a Host that is one always passes.
The origin check keeps a page of another site (or another port of this machine) from posting a form or a `fetch` to
the server; the page at `/` posts to the server itself, its own origin, and passes. Pages of `cors_origins` get
the CORS headers (preflights answered 204) and may read the answers.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import re
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aiayn.serve.limits import ApiError, Limits, read_body

LOCAL_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")
OPEN_ROUTES = {("GET", "/health"), ("HEAD", "/health"), ("GET", "/"), ("HEAD", "/")}  # no key asked
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")


@dataclass(frozen=True)
class Access:
    """Who may call the server.

    Args:
        api_key: the key every request but `/health` and the page must carry (None: no key asked).
        allowed_hosts: names the server is reached by, beyond localhost names and IP addresses ("*": any).
        cors_origins: origins (`https://app.example.com`) of pages allowed to call the server ("*": any).
    """

    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.api_key is not None and (not self.api_key or not self.api_key.isascii()
                                         or not self.api_key.isprintable() or any(c.isspace() for c in self.api_key)):
            raise ValueError("the API key is empty, or holds a space or a character outside ASCII (which no "
                             "Authorization header carries); give a key of printable ASCII characters")
        for host in self.allowed_hosts:
            if not host or any(c in host for c in " /@"):
                raise ValueError(f"allowed host {host!r} is not a host name; give a name such as api.example.com")
        for origin in self.cors_origins:
            parts = urlsplit(origin)
            if origin != "*" and (parts.scheme not in ("http", "https") or not parts.netloc or parts.path
                                  or parts.query):
                raise ValueError(f"CORS origin {origin!r} is not an origin; give scheme://host[:port], e.g. "
                                 "https://app.example.com, or *")

    def host_allowed(self, host: str) -> bool:
        """Whether a request's Host header (name or address, and a port) names this server."""
        name = host_name(host)
        if name in LOCAL_NAMES or name.endswith(".localhost") or "*" in self.allowed_hosts:
            return True
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            return name in {host_name(h) for h in self.allowed_hosts}

    def cors_allows(self, origin: str) -> bool:
        """Whether a page of `origin` may call the server from a browser."""
        return "*" in self.cors_origins or origin.rstrip("/").lower() in {o.lower() for o in self.cors_origins}

    def key_matches(self, key: str | None) -> bool:
        """Whether `key` is the server's key (compared in constant time)."""
        return key is not None and hmac.compare_digest(key.encode(), self.api_key.encode())


# A Host header (RFC 9110 7.2): a name of letters, digits, '-', '_' and '.', an IPv4 address, or an IPv6 address in
# brackets; then, optionally, ':' and a port.
HOST = re.compile(r"(?:[a-z0-9_](?:[a-z0-9_.-]*[a-z0-9_.])?|\[[0-9a-f:.]+(?:%[a-z0-9_.-]+)?\])(?::[0-9]{1,5})?")


def valid_host(host: str) -> bool:
    """Whether a Host header is one host[:port] and nothing else (`localhost:80@evil.example`, `[::1`, `localhost:abc`
    are not)."""
    return HOST.fullmatch(host.strip().lower()) is not None


def host_name(host: str) -> str:
    """The name or address in a Host header, without its port and brackets: `[::1]:8000` -> `::1`."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return (host.split(":", 1)[0] if host.count(":") == 1 else host).rstrip(".")


def cross_origin(headers: Headers) -> bool:
    """Whether a browser sent the request from a page of another origin (Origin, else Sec-Fetch-Site)."""
    origin = headers.get("origin")
    if origin is not None:
        return origin == "null" or urlsplit(origin).netloc.lower() != headers.get("host", "").lower()
    return headers.get("sec-fetch-site", "") in ("cross-site", "same-site")


class Guard:
    """ASGI middleware applying `Access` to every HTTP request (see the module's table)."""

    def __init__(self, app, access: Access, limits: Limits):
        self.app, self.access, self.limits = app, access, limits

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers, method = Headers(scope=scope), scope["method"]
        origin = headers.get("origin")
        allowed = origin is not None and self.access.cors_allows(origin)
        hosts = headers.getlist("host")
        host = hosts[0] if hosts else None
        try:
            if len(hosts) > 1 or (host is not None and not valid_host(host)):
                raise ApiError(400, f"the Host header must be one host[:port], got {', '.join(map(repr, hosts))}")
            if host is not None and not self.access.host_allowed(host):
                raise ApiError(400, f"this server does not answer to the name {host!r} in the Host header; "
                                    f"start it with --allowed-host {host_name(host)} to allow it")
            if method == "OPTIONS" and origin is not None and "access-control-request-method" in headers:
                return await self._preflight(origin, allowed, scope, receive, send)
            if method not in SAFE_METHODS and cross_origin(headers) and not allowed:
                raise ApiError(403, f"a page of another origin ({origin or headers.get('sec-fetch-site')}) may not "
                                    "call this server; start it with --cors-origin ORIGIN to allow one")
            if self.access.api_key is not None and (method, scope["path"]) not in OPEN_ROUTES:
                receive = await self._check_key(scope, headers, receive)
        except ApiError as err:
            return await self._answer(JSONResponse({"error": err.message}, err.status), allowed and origin,
                                      scope, receive, send)
        await self.app(scope, receive, self._with_cors(send, origin) if allowed else send)

    async def _check_key(self, scope, headers: Headers, receive):
        """The request's `receive` (its body replayed, where it was read for an api_key field); 401 without the key."""
        scheme, _, key = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and self.access.key_matches(key.strip()):
            return receive
        query = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("api_key", [None])[0]
        if self.access.key_matches(query):
            return receive
        body = await read_body(Request(scope, receive), self.limits) if _has_body(headers) else b""
        replay = _replaying(body, receive)
        if not self.access.key_matches(await _body_key(scope, headers, body)):
            given = "a wrong key" if key or query or b"api_key" in body else "no key"
            raise ApiError(401, f"this server needs an API key and the request carries {given}: send "
                                "'Authorization: Bearer KEY', or an api_key field (LibreTranslate)")
        return replay

    async def _preflight(self, origin: str, allowed: bool, scope, receive, send):
        if not allowed:
            raise ApiError(403, f"a page of {origin} may not call this server; start it with --cors-origin {origin}")
        response = Response(status_code=204, headers={
            "access-control-allow-methods": "GET, POST", "access-control-max-age": "600",
            "access-control-allow-headers": "authorization, content-type"})
        await self._answer(response, origin, scope, receive, send)

    async def _answer(self, response: Response, origin: str | None | bool, scope, receive, send):
        await response(scope, receive, self._with_cors(send, origin) if origin else send)

    @staticmethod
    def _with_cors(send, origin: str):
        async def sending(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"access-control-allow-origin", origin.encode("latin-1")),
                                                  (b"vary", b"Origin")]}
            await send(message)
        return sending


def _has_body(headers: Headers) -> bool:
    return headers.get("content-length", "0") != "0" or "chunked" in headers.get("transfer-encoding", "").lower()


def _replaying(body: bytes, receive):
    """A `receive` that gives `body` first, then whatever the client sends next (its disconnection)."""
    sent = []

    async def replay():
        if not sent:
            sent.append(True)
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _body_key(scope, headers: Headers, body: bytes) -> str | None:
    """The `api_key` field of a JSON or form body (LibreTranslate's clients send it there), or None."""
    kind = headers.get("content-type", "").split(";")[0].strip().lower()
    try:
        if kind in ("application/x-www-form-urlencoded", "multipart/form-data"):
            form = await Request(scope, _replaying(body, None)).form()
            key = form.get("api_key")
        else:
            fields = json.loads(body) if body else None
            key = fields.get("api_key") if isinstance(fields, dict) else None
    except Exception:  # noqa: BLE001 - a body the route refuses with its own answer (RecursionError included)
        return None
    return key if isinstance(key, str) else None
