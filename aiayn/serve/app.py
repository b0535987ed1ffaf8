"""The ASGI application of `aiayn serve`: LibreTranslate, OpenAI and TEI routes, health, metrics, the page.

| route | speaks | answers |
| --- | --- | --- |
| `POST /translate` | LibreTranslate (JSON or form: `q` one text or a list, `source`, `target`) | `{"translatedText"}` |
| `GET /languages` | LibreTranslate | `[{"code", "name", "targets"}]` |
| `POST /v1/completions` | OpenAI (`prompt`, `model`, `max_tokens`, `temperature`, `top_p`, `stop`...) | completions |
| `POST /v1/embeddings` | OpenAI (`input`, `model`, `encoding_format` float or base64) | `{"object": "list"}` |
| `GET /v1/models` | OpenAI | the models served |
| `POST /embed` | text-embeddings-inference (`inputs`) | a list of vectors |
| `POST /predict` | text-embeddings-inference (`inputs`) | labels with scores (a tagger: a tag per word) |
| `POST /v1/inspect` | the page (`q`, `model`) | a translation with its tokens, cross-attention and pipeline |
| `GET /health`, `GET /metrics`, `GET /` | | status, Prometheus text, the page |

The server keeps no state between requests: replicas can run behind any load balancer.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from importlib import resources

import numpy as np
from fastapi import APIRouter, FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response

from aiayn.config import MAX_INT
from aiayn.serve.batching import Passes, QueueFull
from aiayn.serve.guard import Access, Guard
from aiayn.serve.limits import ApiError, Limits, Stopped, bool_field, read_fields, string_field, texts_field
from aiayn.serve.metrics import Metrics
from aiayn.serve.models import Served, ServedLabeller, ServedTranslator, pick, pick_translator, served_class
from aiayn.serve.stepping_workers import StepWorkers
from aiayn.serve.streaming import completion_stream, cut_at_stop
from aiayn.serve.workers import WorkerPool

logger = logging.getLogger(__name__)

ROUTES = ("/", "/health", "/metrics", "/languages", "/translate", "/v1/completions", "/v1/embeddings", "/v1/models",
          "/embed", "/predict", "/v1/inspect")
GET_ROUTES = ("/", "/health", "/metrics", "/languages", "/v1/models")
FORMATS = ("text", "html")
# The page runs its own inline script and style and calls this server only; no other site may frame it (clickjacking)
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                           "img-src data:; connect-src 'self'; frame-ancestors 'none'; "
                                           "base-uri 'none'; form-action 'self'",
                "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


def page_html() -> str:
    """The page at `/`: one self-contained HTML file (its script and style inline; nothing from a CDN)."""
    return resources.files("aiayn.serve").joinpath("static/index.html").read_text(encoding="utf-8")


class HeadAsGet:
    """ASGI middleware: `HEAD` on a route that answers `GET` gets the same status and headers without the body (RFC
    9110 9.3.2), as load balancers' and monitors' health checks ask."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "HEAD" or scope["path"] not in GET_ROUTES:
            return await self.app(scope, receive, send)

        async def headers_only(message):
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return
                message = {"type": "http.response.body", "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)


class Observed:
    """ASGI middleware: every request's status and latency by route, and the requests in flight; an error no route
    answered becomes a 500 in the server's JSON shape, logged once with its traceback, and a request the stopping
    server cuts (`--drain-seconds` ran out, or a second signal) a 503 in that shape, counted in `Metrics.cut` (one
    whose answer had begun is cut short, in `Metrics.cut_midway`)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in ROUTES else "other"
        status, started, start = [500], [False], time.perf_counter()

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0], started[0] = message["status"], True
            await send(message)

        self.metrics.in_flight += 1
        try:
            await self.app(scope, receive, sending)
        except asyncio.CancelledError:  # the server stopped before answering (its drain time ran out, a second signal)
            if started[0]:  # (a streamed answer, cut: uvicorn closes the connection)
                self.metrics.cut_midway += 1
                return
            self.metrics.cut += 1
            answer = JSONResponse({"error": Stopped().message}, status_code=503, headers={"Connection": "close"})
            await answer(scope, receive, sending)  # (the request's task ends here: the server is stopping it)
        except Exception as err:
            logger.exception("%s %s failed", scope["method"], scope["path"])
            if started[0]:  # the answer was under way: uvicorn closes the connection
                return
            answer = JSONResponse({"error": f"internal error: {type(err).__name__}: {err}"}, status_code=500)
            await answer(scope, receive, sending)
        finally:
            self.metrics.in_flight -= 1
            self.metrics.request_done(route, status[0], time.perf_counter() - start)


async def until_disconnected(request: Request) -> None:
    """Return when the client closes the connection (the body has been read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def answered(request: Request, work: Awaitable):
    """`work`'s result, or cancel it (freeing its place in the queue) when the client goes away first, or when the
    stopping server cuts the request."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # (left running, its end, say the workers' Stopped, would be an error nobody reads)
        task.cancel()
        raise
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ApiError(499, "the client closed the connection")
    return task.result()


@dataclass
class Server:
    """What every route needs: the models served, the limits, the metrics and the forward passes."""

    models: list[Served]
    limits: Limits
    metrics: Metrics
    passes: Passes
    pools: tuple = ()  # the worker processes' pools (`WorkerPool`, `StepWorkers`): `/health` asks each

    async def run(self, request: Request, model: Served, texts: list, tokens: int | None = None) -> list:
        """`model`'s answers to `texts`, batched with other requests (`tokens`: their count where the route made it,
        not made again); errors become the documented statuses."""
        try:
            return await answered(request, model.answer(texts, tokens=tokens))
        except QueueFull as err:
            raise ApiError(429, str(err)) from None
        except ValueError as err:  # the object refused the text (checked before queueing, this is a fallback)
            raise ApiError(422, str(err)) from None


def create_app(objects: Mapping[str, object], *, limits: Limits | None = None, passes: int = 1, threads: int = 1,
               max_tokens: int = 4096, max_batch: int = 0, max_wait: float = 0.005,
               pool: WorkerPool | None = None, access: Access | None = None, stepping: bool = True,
               max_rows: int = 1024, steps: StepWorkers | None = None) -> FastAPI:
    """The application serving `objects` (name -> Translator / Embedder / Classifier / Tagger).

    Args:
        limits: request bounds (`Limits`).
        passes: most forward passes at once; `threads` torch threads each (passes x threads <= cores).
        max_tokens: token budget of a batch gathered across requests; max_batch caps its texts (0: no cap).
        max_wait: seconds the oldest queued request waits (from its arrival) for others to join its batch.
        pool: started worker processes holding the same models (one a pass, `pool.size == passes`): the
            batches run there instead of in the server's threads. The application closes it when it stops.
        access: the API key, Host names and page origins the server accepts (`Access`; default: no key, this
            machine's names and addresses, no other origin).
        stepping: a model that decodes (a translator, a language model) serves its requests from running batches
            that requests join and leave at each step (`aiayn.serve.stepping`), stepped in this process by a thread
            a pass; False batches whole requests as the other models do.
        max_rows: most rows (sentences x beams) of a running batch.
        steps: started worker processes stepping the decoding models they name (`StepWorkers`, one a pass) instead
            of threads of this process. The application closes it when it stops.
    """
    if pool is not None and pool.size != passes:
        raise ValueError(f"a pool of {pool.size} worker processes serves {pool.size} passes, not {passes}")
    server = Server([], limits or Limits(), Metrics(), Passes(passes, threads),
                    tuple(p for p in (pool, steps) if p is not None))
    if steps is not None:
        steps.observe, steps.first_token = server.metrics.step_done, server.metrics.first_token
    for name, obj in objects.items():
        try:
            served = served_class(obj)
        except ValueError as err:
            raise ValueError(f"cannot serve {name!r}: {err}") from None
        server.models.append(served(name, obj, server.passes, server.limits, server.metrics, max_tokens=max_tokens,
                                    max_batch=max_batch, max_wait=max_wait, pool=pool, stepping=stepping,
                                    max_rows=max_rows, steps=steps))

    def close() -> None:
        for model in server.models:
            model.close()
        server.passes.close()
        if pool is not None:
            pool.close()
        if steps is not None:
            steps.close()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(close)  # (the loop meanwhile answers what the closing cuts)

    app = FastAPI(title="aiayn serve", lifespan=lifespan)
    app.state.models, app.state.metrics, app.state.limits = server.models, server.metrics, server.limits
    app.state.access = access or Access()
    app.add_middleware(HeadAsGet)  # (the innermost: the guard sees the request's own method)
    app.add_middleware(Guard, access=app.state.access, limits=server.limits)
    app.add_middleware(Observed, metrics=server.metrics)  # (the outer one: it counts what Guard refuses too)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        if isinstance(err, Stopped):
            server.metrics.cut += 1
        return JSONResponse({"error": err.message}, status_code=err.status)

    @app.exception_handler(HTTPException)
    async def framework_error(request: Request, err: HTTPException) -> JSONResponse:
        """The framework's refusals (an unknown route, a method a route does not take, bad form data), in the
        same shape as the server's own."""
        return JSONResponse({"error": _framework_line(request, err)}, status_code=err.status_code,
                            headers=err.headers)

    for routes in (service_routes, libretranslate_routes, openai_routes, tei_routes):
        app.include_router(routes(server))
    return app


def _framework_line(request: Request, err: HTTPException) -> str:
    """One line for a refusal the framework raised, naming what to do."""
    if err.status_code == 404:
        return f"no route {request.url.path}; the routes are {', '.join(ROUTES)}"
    if err.status_code == 405:
        return f"{request.method} is not a method of {request.url.path}; it takes {err.headers.get('Allow', '')}"
    return f"{err.detail}" if isinstance(err.detail, str) else json.dumps(err.detail)


def service_routes(server: Server) -> APIRouter:
    """The page, `/health`, `/metrics`, and `/v1/inspect` (what the page shows of one translation)."""
    router = APIRouter()

    @router.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(page_html(), headers=PAGE_HEADERS)

    @router.get("/health")
    async def health() -> dict:
        """"ok", or "degraded" while a worker process does not answer (dead or silent: it is being replaced), with
        the workers' counts where the server has worker processes."""
        answer = {"status": "ok", "models": [m.describe() for m in server.models]}
        if server.pools:
            counts = [pool.health() for pool in server.pools]
            answer["workers"] = {key: sum(c[key] for c in counts) for key in counts[0]}
            if answer["workers"]["answering"] < answer["workers"]["processes"]:
                answer["status"] = "degraded"
        return answer

    @router.get("/metrics")
    async def metrics_text() -> Response:
        return PlainTextResponse(server.metrics.render(), media_type="text/plain; version=0.0.4")

    @router.post("/v1/inspect")
    async def inspect(request: Request) -> dict:
        fields = await read_fields(request, server.limits)
        texts, single = texts_field(fields, "q", server.limits)
        if not single:
            raise ApiError(422, "the field 'q' must be one string here")
        model = pick(server.models, "translate", string_field(fields, "model"))
        count = model.count_tokens(texts)  # 422 for a text the model cannot take
        loop = asyncio.get_running_loop()
        async with server.passes.held():
            result = await loop.run_in_executor(server.passes.executor, model.inspect, texts[0])
        return {**result, "tokens": count}

    return router


def libretranslate_routes(server: Server) -> APIRouter:
    """LibreTranslate's `/translate` (JSON or form data) and `/languages`."""
    router = APIRouter()

    @router.get("/languages")
    async def languages() -> list:
        by_source: dict[str, list[str]] = {}
        for m in server.models:
            if isinstance(m, ServedTranslator):
                by_source.setdefault(m.source, []).append(m.target)
        return [{"code": code, "name": code, "targets": targets} for code, targets in by_source.items()]

    @router.post("/translate")
    async def translate(request: Request) -> JSONResponse:
        fields = await read_fields(request, server.limits, form=True)
        texts, single = texts_field(fields, "q", server.limits)
        source, target = string_field(fields, "source", "auto"), string_field(fields, "target")
        string_field(fields, "format", "text", FORMATS)  # html is translated as text: tags are text to the model
        model = pick_translator(server.models, source, target)
        out = await server.run(request, model, texts)
        answer: dict = {"translatedText": out[0] if single else out}
        if source == "auto":
            answer["detectedLanguage"] = {"confidence": 100.0, "language": model.source}
        return JSONResponse(answer)

    return router


def openai_routes(server: Server) -> APIRouter:
    """OpenAI's `/v1/completions`, `/v1/embeddings` (float or base64 vectors) and `/v1/models`."""
    router = APIRouter()

    @router.post("/v1/completions")
    async def openai_completions(request: Request) -> JSONResponse:
        fields = await read_fields(request, server.limits)
        prompts, _ = texts_field(fields, "prompt", server.limits)
        model = pick(server.models, "complete", string_field(fields, "model"))
        settings, stops, echo = completion_settings(fields)
        if _stream_asked(fields):
            try:
                return completion_stream(model, prompts, settings, stops, echo)
            except QueueFull as err:
                raise ApiError(429, str(err)) from None
        items = [(p, settings) for p in prompts]
        tokens = model.count_tokens(items)
        results = await server.run(request, model, items, tokens)
        choices = []
        for i, (prompt, result) in enumerate(zip(prompts, results)):
            text, stopped = cut_at_stop(result.text, stops)
            finish = "stop" if stopped or result.ended else "length"
            choices.append({"text": prompt + text if echo else text, "index": i, "logprobs": None,
                            "finish_reason": finish})
        new_tokens = sum(len(r.tokens) for r in results)
        return JSONResponse({"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                             "model": model.name, "choices": choices,
                             "usage": {"prompt_tokens": tokens, "completion_tokens": new_tokens,
                                       "total_tokens": tokens + new_tokens}})

    @router.post("/v1/embeddings")
    async def openai_embeddings(request: Request) -> JSONResponse:
        fields = await read_fields(request, server.limits)
        texts, _ = texts_field(fields, "input", server.limits)
        encoding = string_field(fields, "encoding_format", "float", ("float", "base64"))
        model = pick(server.models, "embed", string_field(fields, "model"))
        tokens = model.count_tokens(texts, truncate=False)  # OpenAI's: a text too long is an error
        vectors = await server.run(request, model, texts, tokens)
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")
                 if encoding == "base64" else np.asarray(v, dtype=np.float32).tolist()} for i, v in enumerate(vectors)]
        return JSONResponse({"object": "list", "data": data, "model": model.name,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    @router.get("/v1/models")
    async def openai_models() -> dict:
        return {"object": "list",
                "data": [{"id": m.name, "object": "model", "owned_by": "aiayn"} for m in server.models]}

    return router


# OpenAI completion fields this server does not implement, with the values that mean "off"
UNSUPPORTED_COMPLETION_FIELDS = {"logprobs": (None,), "best_of": (None, 1), "suffix": (None,),
                                 "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0),
                                 "frequency_penalty": (None, 0, 0.0)}


def _stream_asked(fields: dict) -> bool:
    """Whether an OpenAI completions request asks for server-sent events (`stream`: true, false or null)."""
    stream = fields.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(422, f"the field 'stream' must be true or false, got {stream!r}")
    return bool(stream)


def completion_settings(fields: dict) -> tuple[tuple, list[str], bool]:
    """(the `Generator.generate` settings as sorted pairs, the stop strings, echo) of an OpenAI completions request:
    `max_tokens` (16), `temperature` (1; 0 takes the most likely token), `top_p` (1), `seed`, `stop`, `echo`, and
    as vLLM's server takes them beside OpenAI's, `top_k` (0: off) and `repetition_penalty` (1: off). A sampling
    setting that is not off with `temperature` 0 is refused, as `aiayn generate` and `Generator.generate` refuse
    it without sampling."""
    def number(name: str, default: float, low: float, high: float) -> float:
        value = fields.get(name, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise ApiError(422, f"the field {name!r} must be a number from {low} to {high}, got {value!r}")
        return value

    max_tokens = fields.get("max_tokens", 16)
    if max_tokens is None:
        max_tokens = 16
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ApiError(422, f"the field 'max_tokens' must be a positive integer, got {max_tokens!r}")
    n = fields.get("n", 1)
    if n is not None and (type(n) is not int or n != 1):
        raise ApiError(422, "the field 'n' must be 1: this server returns one completion a prompt")
    for name, off in UNSUPPORTED_COMPLETION_FIELDS.items():
        if fields.get(name) not in off:
            raise ApiError(422, f"the field {name!r} is not supported by this server: leave it out")
    seed = fields.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ApiError(422, f"the field 'seed' must be a non-negative integer, got {seed!r}")
    if seed is not None and seed > MAX_INT:
        raise ApiError(422, f"the field 'seed' must be at most {MAX_INT:,}, got {seed}")
    stop = fields.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise ApiError(422, "the field 'stop' must be a string or a list of at most 4 non-empty strings")
    echo = fields.get("echo", False)
    if not isinstance(echo, bool):
        raise ApiError(422, f"the field 'echo' must be true or false, got {echo!r}")
    temperature = number("temperature", 1.0, 0.0, 2.0)
    top_p = number("top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise ApiError(422, "the field 'top_p' must be above 0")
    top_k = fields.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise ApiError(422, f"the field 'top_k' must be a non-negative integer (0: off), got {top_k!r}")
    repetition_penalty = number("repetition_penalty", 1.0, 0.0, 10.0)
    if repetition_penalty == 0:
        raise ApiError(422, "the field 'repetition_penalty' must be above 0 (1: off)")
    sampling = {"top_p": (top_p, 1.0), "top_k": (top_k or 0, 0)}
    if temperature == 0 and any(value != off for value, off in sampling.values()):
        name = next(name for name, (value, off) in sampling.items() if value != off)
        raise ApiError(422, f"the field {name!r} shapes sampling, and 'temperature' 0 takes the most likely token: "
                            "give a temperature above 0, or leave it out")
    settings = {"max_new_tokens": min(max_tokens, 4096), "do_sample": temperature > 0, "seed": seed}
    if temperature > 0:
        settings.update(temperature=float(temperature), top_p=float(top_p), top_k=int(top_k or 0))
    if repetition_penalty != 1:
        settings["repetition_penalty"] = float(repetition_penalty)
    return tuple(sorted(settings.items())), stops, echo


def tei_routes(server: Server) -> APIRouter:
    """text-embeddings-inference's `/embed` and `/predict`."""
    router = APIRouter()

    @router.post("/embed")
    async def tei_embed(request: Request) -> JSONResponse:
        fields = await read_fields(request, server.limits)
        texts, _ = texts_field(fields, "inputs", server.limits)
        model = pick(server.models, "embed", string_field(fields, "model"))
        tokens = model.count_tokens(texts, bool_field(fields, "truncate"))  # too long: 422, unless TEI's truncate
        vectors = await server.run(request, model, texts, tokens)
        return JSONResponse([np.asarray(v, dtype=np.float32).tolist() for v in vectors])

    @router.post("/predict")
    async def tei_predict(request: Request) -> list:
        fields = await read_fields(request, server.limits)
        texts, single = texts_field(fields, "inputs", server.limits)
        model = pick(server.models, "predict", string_field(fields, "model"))
        tokens = model.count_tokens(texts, bool_field(fields, "truncate"))  # too long: 422, unless TEI's truncate
        out = [ServedLabeller.as_json(r) for r in await server.run(request, model, texts, tokens)]
        return out[0] if single else out

    return router
