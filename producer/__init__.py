"""pagedq's producer side: the protocol and the clients a web app uses. Imports neither torch nor the engine.

The clients are imported on first use, so that `producer.defaults`, `producer.wire` and `producer.protocol`
load without the `redis` package (the GPU check runs where it is not installed).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from producer.async_client import AsyncClient, AsyncJob
    from producer.client import Client, Job
    from producer.errors import DuplicateJobError, JobNotFound, LeaseLost, PagedqError
    from producer.keys import Keys
    from producer.protocol import (
        ErrorInfo,
        JobRequest,
        JobResult,
        Limits,
        Message,
        StreamEvent,
        Timings,
        Usage,
    )
    from producer.ride import RedisUnavailable

_HOMES = {
    "AsyncClient": "producer.async_client", "AsyncJob": "producer.async_client",
    "Client": "producer.client", "Job": "producer.client",
    "DuplicateJobError": "producer.errors", "JobNotFound": "producer.errors", "LeaseLost": "producer.errors",
    "PagedqError": "producer.errors",
    "Keys": "producer.keys", "RedisUnavailable": "producer.ride",
    "ErrorInfo": "producer.protocol", "JobRequest": "producer.protocol", "JobResult": "producer.protocol",
    "Limits": "producer.protocol", "Message": "producer.protocol", "StreamEvent": "producer.protocol",
    "Timings": "producer.protocol", "Usage": "producer.protocol",
}

__all__ = [
    "AsyncClient", "AsyncJob", "Client", "DuplicateJobError", "ErrorInfo", "Job", "JobNotFound", "JobRequest",
    "JobResult", "Keys", "LeaseLost", "Limits", "Message", "PagedqError", "RedisUnavailable", "StreamEvent",
    "Timings", "Usage",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'producer' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
