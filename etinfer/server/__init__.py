"""The OpenAI-compatible HTTP server (``etinfer serve``) and its Prometheus metrics.

- ``app``: routes, API key, lifetime of the engine loop;
- ``engine_loop``: the one thread that owns the engine, and the requests' view of it;
- ``serving``: validation, submission, answers and server-sent events;
- ``protocol`` / ``responses``: OpenAI's request and response shapes;
- ``errors``: OpenAI's error shape for every failure; ``metrics``: Prometheus.
"""

from etinfer.server.app import create_app, serve

__all__ = ["create_app", "serve"]
