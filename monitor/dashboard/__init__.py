"""`pagedq dashboard`: a live page over Redis (queues, workers, charts, dead letters, a prompt form).
`create_app(redis_url, queue)` is the ASGI app, to run alone or to mount in another app."""

from monitor.dashboard.app import create_app

__all__ = ["create_app"]
