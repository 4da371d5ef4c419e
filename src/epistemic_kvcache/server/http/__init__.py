"""The HTTP/1.1 `/kv` listener (docs/http-api.md).

- `connection`: the asyncio protocol: parsing, admission, back-pressure, accounting, timers.
- `routes`: the one route table (methods, body rules, handlers) of core and engine routes.
- `api`: `Request`, `Response`, `HttpError` and the table's row types.
- `core`, `engine`: the handlers.
"""

from epistemic_kvcache.server.http.connection import HttpConnection, make_http_factory
from epistemic_kvcache.server.http.core import batch_header_limit

__all__ = ["HttpConnection", "batch_header_limit", "make_http_factory"]
