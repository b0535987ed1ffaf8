"""`aiayn serve`: serve runs and pretrained encoders over HTTP (LibreTranslate / OpenAI / TEI routes, a page)."""

from __future__ import annotations

import argparse
import os
import socket
import sys

from aiayn.cli.options import add_device_argument


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `aiayn serve`."""
    p = subparsers.add_parser(
        "serve", help="serve trained models over HTTP: LibreTranslate, OpenAI and TEI routes, metrics, a page",
        description="Serve any mix of runs and pretrained encoders. Routes: POST /translate and GET /languages "
                    "(LibreTranslate), POST /v1/embeddings (OpenAI), POST /embed and POST /predict (TEI), "
                    "GET /health, GET /metrics (Prometheus), and a page at / that shows a translation's "
                    "cross-attention and the pipeline. Requests arriving together are batched; SIGTERM drains "
                    "the requests in flight, then exits. Size replicas so processes x --threads x --passes "
                    "<= cores.")
    p.add_argument("--run", action="append", default=[], metavar="[NAME=]DIR",
                   help="a run or model directory to serve (repeatable); NAME defaults to the directory's name, "
                        "and a translator named SRC-TGT (en-de=runs/x) is listed under those languages")
    p.add_argument("--model", action="append", default=[], metavar="[NAME=]MODEL",
                   help="a pretrained encoder to serve, e.g. minilm (repeatable)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one and prints it)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per forward pass (default 1)")
    p.add_argument("--passes", type=int, default=0,
                   help="most forward passes at once (default: cores // --threads, so they never exceed the cores)")
    p.add_argument("--in-threads", action="store_true",
                   help="run every pass in a thread of the server's process (less memory: one copy of each model; "
                        "but the passes then take turns at Python's lock). Default on CPU with more than one pass: "
                        "a worker process per pass")
    p.add_argument("--max-wait-ms", type=float, default=5.0,
                   help="how long the oldest queued request waits for others to batch with (default 5 ms)")
    p.add_argument("--max-tokens", type=int, default=4096, help="token budget of one batch (default 4096)")
    p.add_argument("--max-batch", type=int, default=0,
                   help="most texts in one batch (default 0: no cap beyond --max-tokens)")
    p.add_argument("--max-texts", type=int, default=128, help="most texts in one request (default 128; more: 413)")
    p.add_argument("--max-chars", type=int, default=5000, help="most characters in one text (default 5000; 413)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB; 413)")
    p.add_argument("--max-queue", type=int, default=1024, help="most texts waiting per model (default 1024; 429)")
    p.add_argument("--drain-seconds", type=float, default=30.0,
                   help="on SIGTERM, how long requests in flight may take to finish (default 30)")
    add_device_argument(p)
    p.set_defaults(func=cmd_serve)


def _named(spec: str) -> tuple[str, str]:
    name, sep, path = spec.partition("=")
    if not sep:
        path = spec
        name = os.path.basename(os.path.normpath(spec)) or spec
    if not name or not path:
        raise ValueError(f"{spec!r}: give DIR or NAME=DIR")
    return name, path


def _sources(args: argparse.Namespace) -> dict[str, str]:
    """Model name -> what `aiayn.load` takes, from --run and --model."""
    specs = [_named(spec) for spec in [*args.run, *args.model]]
    if not specs:
        raise ValueError("nothing to serve: give --run DIR and/or --model minilm")
    names = [name for name, _ in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"two models share a name ({', '.join(names)}); give them names as NAME=DIR")
    return dict(specs)


def cmd_serve(args: argparse.Namespace) -> int:
    """Load the models, bind the port, serve until SIGTERM / Ctrl-C, and drain the requests in flight."""
    try:
        import uvicorn

        from aiayn.serve import Limits, create_app
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(f"aiayn serve needs the serve extra ({err.name} is missing): "
                                  "pip install 'aiayn[serve]'") from None
    import torch

    import aiayn
    from aiayn.backends import usable_cores
    from aiayn.serve.workers import WorkerPool

    if args.threads < 1 or args.passes < 0:
        raise ValueError(f"--threads must be at least 1 and --passes not negative, got {args.threads}, {args.passes}")
    cores = usable_cores()
    passes = args.passes or max(1, cores // args.threads)
    torch.set_num_threads(args.threads)
    limits = Limits(max_body_bytes=args.max_body_bytes, max_texts=args.max_texts, max_chars=args.max_chars,
                    max_queue=args.max_queue)
    sources = _sources(args)
    objects = {name: aiayn.load(source, device=args.device) for name, source in sources.items()}
    on_cpu = all(obj.device.type == "cpu" for obj in objects.values())
    pool = None
    if passes > 1 and on_cpu and not args.in_threads:  # a process a pass: passes in threads share Python's lock
        pool = WorkerPool(sources, passes, threads=args.threads, device=args.device)
        pool.start()
    app = create_app(objects, limits=limits, passes=passes, threads=args.threads, max_tokens=args.max_tokens,
                     max_batch=args.max_batch, max_wait=args.max_wait_ms / 1000, pool=pool)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(2048)  # connections wait in the backlog from now on, while uvicorn starts
    host, port = sock.getsockname()[:2]
    names = ", ".join(f"{m.name} ({m.kind})" for m in app.state.models)
    where = f"{passes} worker processes" if pool is not None else f"{passes} passes in threads"
    print(f"aiayn serve: http://{host}:{port} serving {names}; {where} x {args.threads} torch threads "
          f"on {cores} cores", file=sys.stderr, flush=True)
    if passes * args.threads > cores:
        print(f"aiayn serve: warning: {passes} passes x {args.threads} threads ask for more than the {cores} cores; "
              "each pass will wait for the others", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=args.drain_seconds,
                                           lifespan="on"))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn drained the requests in flight, then passed the signal on
        pass
    print("aiayn serve: stopped after the requests in flight were answered", file=sys.stderr, flush=True)
    return 0
