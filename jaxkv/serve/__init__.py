"""OpenAI-compatible HTTP server over the continuous-batching engine: `python -m jaxkv.serve`.

Modules: `protocol` (schemas, validation, error bodies),
`engine_loop` (the engine's thread), `metrics` (Prometheus), `app` (routes), `server` (wiring, uvicorn).
"""

from jaxkv.serve.app import ServerState, build_app

__all__ = ["ServerState", "build_app"]
