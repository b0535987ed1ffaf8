"""The serving peer of `aiayn bench serve --mixed`: a CTranslate2 translator behind aiayn's own HTTP front.

What a LibreTranslate-style deployment is: an HTTP server that gathers whole requests into batches and hands each batch
to CTranslate2 (`translate_batch`, beam 4, length penalty 0.6, as `aiayn translate`). The front is `aiayn serve`'s
(the same routes, limits, batcher with `--batching requests` and its gathering window), so the two servers differ
only in what runs a batch: `passes` threads of this process, each handing its batch to one CTranslate2 engine whose
`inter_threads` run that many batches side by side, a core each (CTranslate2 releases Python's lock while it
translates). The run's CTranslate2 export is written to a temporary folder first.

    python benchmarks/ctranslate2_front.py --run RUN --pair en-es --passes 2

It prints `aiayn serve: http://HOST:PORT serving ...` when it listens, as `aiayn serve` does, and stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from file import ctranslate2_engines  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="translation run (its CTranslate2 export is what runs)")
    p.add_argument("--pair", default="en-de", help="the language pair it is served as")
    p.add_argument("--passes", type=int, default=1, help="batches at once (CTranslate2's inter_threads)")
    p.add_argument("--max-tokens", type=int, default=4096, help="most source tokens of a gathered batch")
    args = p.parse_args(argv)

    import ctranslate2
    import torch

    import aiayn
    from aiayn.serve import create_app, server_config
    from aiayn.serve.connections import DrainingServer

    torch.set_num_threads(1)
    translator = aiayn.load(args.run)
    with tempfile.TemporaryDirectory(prefix="aiayn-ct2-") as folder:
        whole, _ = ctranslate2_engines(translator, Path(folder) / "ct2", "fp32", args.passes, args.max_tokens)
        app = create_app({args.pair: translator}, passes=args.passes, threads=1, max_tokens=args.max_tokens,
                         stepping=False)
        served = app.state.models[0]
        # A batch runs in CTranslate2 (the texts answered when the batch ends: it tells of none sooner).
        served.call = lambda obj, texts, max_tokens=args.max_tokens, on_result=None: whole(texts, 4)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(2048)
        port = sock.getsockname()[1]
        print(f"aiayn serve: http://127.0.0.1:{port} serving {args.pair} (translate, CTranslate2 "
              f"{ctranslate2.__version__} fp32); {args.passes} batches at once x 1 thread",
              file=sys.stderr, flush=True)
        DrainingServer(server_config(app)).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
