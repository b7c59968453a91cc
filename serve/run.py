"""`pagedq serve`: uvicorn on the ASGI factory, with the command line's settings handed over in the environment
(uvicorn's worker processes import the factory afresh and read them there).

SIGHUP rereads the API key file in each server process (serve.app). With `--workers N`, uvicorn's supervisor
would restart every worker on SIGHUP (cutting the streams they serve); pagedq's passes the signal on to them
instead, so that each rereads its keys and keeps its connections."""

from __future__ import annotations

import inspect
import os
import signal

from serve.config import ServeConfig


def run_server(config: ServeConfig, host: str, port: int, workers: int = 1, log_level: str = "info") -> None:
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError:
        raise RuntimeError("pagedq serve needs FastAPI and uvicorn: pip install 'pagedq[serve]'") from None
    os.environ.update(config.to_env())
    settings = {"factory": True, "host": host, "port": port, "workers": workers, "log_level": log_level.lower(),
                "timeout_graceful_shutdown": 10}
    if workers <= 1:
        uvicorn.run("serve.app:create_app", **settings)
        return
    _supervise(uvicorn.Config("serve.app:create_app", **settings))


def _supervise(config) -> None:
    """uvicorn.run's --workers path (uvicorn >= 0.30), with SIGHUP passed on to the workers."""
    from uvicorn import Server
    from uvicorn.supervisors import Multiprocess

    class Supervisor(Multiprocess):
        def handle_hup(self) -> None:
            for process in self.processes:
                if process.pid is not None:
                    os.kill(process.pid, signal.SIGHUP)

    sock = config.bind_socket()
    extra = {}
    if "target" in inspect.signature(Multiprocess.__init__).parameters:  # the uvicorns of 2024-2025
        extra["target"] = Server(config=config).run
    try:
        Supervisor(config, sockets=[sock], **extra).run()
    finally:
        sock.close()
