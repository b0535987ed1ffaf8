"""`aiayn serve`: trained models behind HTTP, in the APIs existing clients speak, batched across requests.

`create_app(objects)` builds the ASGI application (`aiayn.serve.app`) and `server_config(app)` uvicorn's settings
for it (`aiayn.serve.connections` bounds each connection); `aiayn.serve.guard` checks the API key, the Host and the
calling page's origin; `aiayn.serve.batching` gathers requests into batches; `aiayn.serve.limits` bounds what a
request may hold; `aiayn.serve.metrics`
keeps the Prometheus counters; the page at `/` is `static/index.html`. Needs the `serve` extra
(`pip install 'aiayn[serve]'`: FastAPI, uvicorn, python-multipart).
"""

from aiayn.serve.app import create_app
from aiayn.serve.connections import server_config
from aiayn.serve.guard import Access
from aiayn.serve.limits import Limits

__all__ = ["Access", "Limits", "create_app", "server_config"]
