"""`aiayn serve`: serve runs and pretrained encoders over HTTP (LibreTranslate / OpenAI / TEI routes, a page)."""

from __future__ import annotations

import argparse
import errno
import ipaddress
import os
import socket
import sys

from aiayn.cli.options import add_device_argument, integer, number

KEY_VARIABLE = "AIAYN_API_KEY"  # where --api-key is read from when not given
MAX_WAIT_MS = 10_000  # a longer gathering window only delays lone requests
MAX_SECONDS = 3600.0
MAX_BODY_BYTES = 1 << 30
MAX_PASSES = 1024  # (a worker process each)
SPARE_FILES = 64  # open files the server needs beyond its connections: models, pipes to the workers, logs


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
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; beyond it, set an --api-key)")
    p.add_argument("--port", type=integer(0, 65535), default=8000,
                   help="port (default 8000; 0 picks a free one and prints it)")
    p.add_argument("--threads", type=integer(1, MAX_PASSES), default=1,
                   help="torch threads per forward pass (default 1; more than the cores are cut to the cores, with a "
                        "warning, as in training)")
    p.add_argument("--passes", type=integer(0, MAX_PASSES), default=0,
                   help="most forward passes at once (default: cores // --threads on CPU, so they never exceed the "
                        "cores; 1 on a GPU)")
    p.add_argument("--in-threads", action="store_true",
                   help="run every pass in a thread of the server's process (less memory: one copy of each model; "
                        "but the passes then take turns at Python's lock). Default on CPU with more than one pass: "
                        "a worker process per pass")
    p.add_argument("--batching", choices=("steps", "requests"), default="steps",
                   help="how a model that decodes (translator, language model) batches: 'steps' (default), running "
                        "batches that requests join and leave at every decoding step, stepped by a thread a pass in "
                        "the server's process (a short request never waits for long ones to end; completions can "
                        "stream); 'requests', whole requests gathered into batches, as encoders are")
    p.add_argument("--max-rows", type=integer(1), default=1024,
                   help="most rows (sentences x beams) of a running batch (default 1024; more requests wait)")
    p.add_argument("--max-wait-ms", type=number(0, MAX_WAIT_MS), default=5.0,
                   help="how long the oldest queued request waits for others to batch with (default 5 ms; "
                        f"at most {MAX_WAIT_MS:,} ms)")
    p.add_argument("--max-tokens", type=integer(1), default=4096, help="token budget of one batch (default 4096)")
    p.add_argument("--max-batch", type=integer(0), default=0,
                   help="most texts in one batch (default 0: no cap beyond --max-tokens)")
    p.add_argument("--max-texts", type=integer(1), default=128,
                   help="most texts in one request (default 128; more: 413)")
    p.add_argument("--max-chars", type=integer(1), default=5000,
                   help="most characters in one text (default 5000; 413)")
    p.add_argument("--max-body-bytes", type=integer(1, MAX_BODY_BYTES), default=1 << 20,
                   help="largest request body (default 1 MiB; 413)")
    p.add_argument("--max-queue", type=integer(1), default=1024,
                   help="most texts waiting per model (default 1024; 429)")
    p.add_argument("--max-connections", type=integer(1), default=512,
                   help="most connections open at once (default 512, as TEI's --max-concurrent-requests and "
                        "nginx's worker_connections; more are answered 503)")
    p.add_argument("--read-timeout", type=number(0.1, MAX_SECONDS), default=30.0,
                   help="seconds a client has to send a request's headers, and again its body (default 30; 408)")
    p.add_argument("--drain-seconds", type=number(0, MAX_SECONDS), default=30.0,
                   help="on SIGTERM, how long requests in flight may take to finish (default 30)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"a key every request but GET /health and the page must carry (default: ${KEY_VARIABLE}): "
                        "'Authorization: Bearer KEY' (OpenAI, TEI) or an api_key field (LibreTranslate)")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="a name clients reach this server by, beyond localhost and IP addresses (repeatable; "
                        "requests naming another Host are refused: DNS rebinding)")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="a web page's origin allowed to call this server from a browser, e.g. "
                        "https://app.example.com, or * for any (repeatable; default: the server's own page only)")
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


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to `host`:`port` and listening; one clear error where it cannot be (bad --host: ValueError;
    the port taken or privileged: OSError, the system's refusal)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as err:
        raise ValueError(f"--host {host!r} is neither an address nor a name this machine resolves ({err.strerror}); "
                         "give an address of this machine, e.g. 127.0.0.1 or 0.0.0.0") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)  # connections wait in the backlog from now on, while uvicorn starts
    except OSError as err:
        sock.close()
        where = f"{host}:{port}"
        if err.errno == errno.EADDRINUSE:
            raise OSError(err.errno, f"cannot listen on {where}: another program listens there; close it, or choose "
                                     "another --port (0 picks a free one)") from None
        if err.errno in (errno.EACCES, errno.EPERM):
            raise OSError(err.errno, f"cannot listen on {where}: ports below 1024 need privileges; choose "
                                     "--port 1024 or above") from None
        if err.errno == errno.EADDRNOTAVAIL:
            raise ValueError(f"cannot listen on {where}: {host} is not an address of this machine; give one of "
                             "its addresses, or 0.0.0.0 for all") from None
        raise OSError(err.errno, f"cannot listen on {where}: {err.strerror}") from None
    return sock


def _access(args: argparse.Namespace, host: str):
    """Who may call the server: --api-key (or $AIAYN_API_KEY), --allowed-host, --cors-origin."""
    from aiayn.serve import Access

    key = args.api_key if args.api_key is not None else os.environ.get(KEY_VARIABLE)  # set but empty: refused
    return Access(api_key=key, allowed_hosts=(host, *args.allowed_host), cors_origins=tuple(args.cors_origin))


def _open_files_for(connections: int) -> None:
    """Make room for `connections` open connections in the process's open-file limit (raising its soft limit up to
    the hard one); ValueError when even that is too few."""
    try:
        import resource
    except ImportError:  # (not on Windows)
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = connections + SPARE_FILES
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            raise ValueError(f"--max-connections {connections} needs {needed} open files, more than this process may "
                             f"open ({hard}, ulimit -n); lower it, or raise the limit")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def cmd_serve(args: argparse.Namespace) -> int:
    """Check every option, load the models, bind the port, start the workers, then serve until SIGTERM / Ctrl-C
    and drain the requests in flight. A failure before serving leaves nothing running."""
    try:
        import uvicorn  # noqa: F401 - (the serve extra: uvicorn with httptools)

        from aiayn.serve import Limits, create_app, server_config
        from aiayn.serve.connections import DrainingServer
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(f"aiayn serve needs the serve extra ({err.name} is missing): "
                                  "pip install 'aiayn[serve]'") from None
    import torch

    from aiayn.backends.devices import threads_within_cores, usable_cores
    from aiayn.inference.loading import load_to_serve
    from aiayn.serve.models import batched_call, served_class, stepped_parts
    from aiayn.serve.stepping_workers import StepWorkers
    from aiayn.serve.workers import WorkerPool

    cores = usable_cores()
    limits = Limits(max_body_bytes=args.max_body_bytes, max_texts=args.max_texts, max_chars=args.max_chars,
                    max_queue=args.max_queue, read_seconds=args.read_timeout, max_connections=args.max_connections)
    sources = _sources(args)
    if not args.host.strip():
        raise ValueError("--host '' names no address; give one to listen on, e.g. 127.0.0.1 (this machine) or 0.0.0.0 "
                         "(every address)")
    access = _access(args, args.host)
    _open_files_for(args.max_connections)
    threads, cut = threads_within_cores(args.threads, f"--threads {args.threads}", "serving")  # as training does
    if cut:
        print(f"aiayn serve: warning: {cut}", file=sys.stderr, flush=True)
    torch.set_num_threads(threads)
    objects = {name: load_to_serve(source, device=args.device) for name, source in sources.items()}
    sock = _listen(args.host, args.port)
    on_cpu = all(obj.device.type == "cpu" for obj in objects.values())
    # On a GPU one pass at a time: its batch fills the device, and passes in threads would take turns at it anyway.
    passes = args.passes or (max(1, cores // threads) if on_cpu else 1)
    pool = steps = None
    try:
        stepping = args.batching == "steps"
        decoding = {name for name in sources if stepping and served_class(objects[name]).stepped}
        batched = {name: source for name, source in sources.items() if name not in decoding}
        in_processes = passes > 1 and on_cpu and not args.in_threads  # passes in threads share Python's lock
        if in_processes and batched:
            pool = WorkerPool(batched, passes, batched_call=batched_call, threads=threads, device=args.device)
            pool.start()
        if in_processes and decoding:
            steps = StepWorkers({name: sources[name] for name in decoding}, passes, parts=stepped_parts,
                                threads=threads, device=args.device, max_rows=args.max_rows,
                                max_tokens=args.max_tokens, max_queue=args.max_queue)
            steps.start()
        app = create_app(objects, limits=limits, passes=passes, threads=threads, max_tokens=args.max_tokens,
                         max_batch=args.max_batch, max_wait=args.max_wait_ms / 1000, pool=pool, access=access,
                         stepping=stepping, max_rows=args.max_rows, steps=steps)
        _announce(app, sock, passes, threads, cores, pool is not None, access, steps_in_workers=steps is not None)
        server = DrainingServer(server_config(app, drain_seconds=args.drain_seconds))
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:  # uvicorn drained the requests in flight, then passed the signal on
            pass
    finally:
        if pool is not None:  # (the application closes it when it ends; not if it never started)
            pool.close()
        if steps is not None:
            steps.close()
        sock.close()
    cut, midway = app.state.metrics.cut, app.state.metrics.cut_midway
    if cut or midway:
        why = "a second signal came" if server.force_exit else f"--drain-seconds ({args.drain_seconds:g}) ran out"
        what = [f"{cut} request{'s' * (cut != 1)} in flight (each answered 503)"] if cut else []
        what += [f"{midway} answer{'s' * (midway != 1)} under way (cut short)"] if midway else []
        print(f"aiayn serve: stopped before finishing {' and '.join(what)}: {why}", file=sys.stderr, flush=True)
        return 130
    print("aiayn serve: stopped after the requests in flight were answered", file=sys.stderr, flush=True)
    return 0


def _announce(app, sock: socket.socket, passes: int, threads: int, cores: int, in_workers: bool, access, *,
              steps_in_workers: bool = False) -> None:
    """The first line on stderr (where it listens, what it serves and in which precision, how it uses the cores), and
    warnings."""
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    names = ", ".join(f"{m.name} ({m.kind}, {m.obj.backend.precision})" for m in app.state.models)
    where = f"{passes} worker processes" if in_workers else f"{passes} passes in threads"
    stepped = [m.name for m in app.state.models if m.stepper is not None]
    if stepped:
        batched = len(stepped) < len(app.state.models)
        steppers = "worker processes" if steps_in_workers else "stepping threads"
        where = (f"{', '.join(stepped)} in running batches, {passes} {steppers} x {threads} torch threads"
                 + (f"; the others in {where} x {threads}" if batched else ""))
    else:
        where = f"{where} x {threads} torch threads"
    print(f"aiayn serve: http://{shown}:{port} serving {names}; {where} on {cores} cores", file=sys.stderr,
          flush=True)
    if passes * threads > cores:
        print(f"aiayn serve: warning: {passes} passes x {threads} threads ask for more than the {cores} cores; "
              "each pass will wait for the others", file=sys.stderr, flush=True)
    if access.api_key is None and not ipaddress.ip_address(host.split("%")[0]).is_loopback:
        print(f"aiayn serve: warning: listening on {host}, beyond this machine, with no API key: anyone who reaches "
              f"it can use it; set --api-key or ${KEY_VARIABLE}", file=sys.stderr, flush=True)
