"""`aiayn serve`: trained models behind HTTP, in the APIs existing clients speak, batched across requests.

`create_app(objects)` builds the ASGI application (`aiayn.serve.app`); `aiayn.serve.batching` gathers
requests into batches; `aiayn.serve.limits` bounds what a request may hold; `aiayn.serve.metrics`
keeps the Prometheus counters; the page at `/` is `static/index.html`. Needs the `serve` extra
(`pip install 'aiayn[serve]'`: FastAPI, uvicorn, python-multipart).
"""

from aiayn.serve.app import create_app
from aiayn.serve.limits import Limits

__all__ = ["Limits", "create_app"]
