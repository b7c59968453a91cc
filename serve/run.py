"""`pagedq serve`: uvicorn on the ASGI factory, with the command line's settings handed over in the environment
(uvicorn's worker processes import the factory afresh and read them there)."""

from __future__ import annotations

import os

from serve.config import ServeConfig


def run_server(config: ServeConfig, host: str, port: int, workers: int = 1, log_level: str = "info") -> None:
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError:
        raise RuntimeError("pagedq serve needs FastAPI and uvicorn: pip install 'pagedq[serve]'") from None
    os.environ.update(config.to_env())
    uvicorn.run("serve.app:create_app", factory=True, host=host, port=port, workers=workers,
                log_level=log_level.lower(), timeout_graceful_shutdown=10)
