"""pagedq's producer side: the protocol and the clients a web app uses. Imports neither torch nor the engine."""

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

__all__ = [
    "AsyncClient", "AsyncJob", "Client", "DuplicateJobError", "ErrorInfo", "Job", "JobNotFound", "JobRequest",
    "JobResult", "Keys", "LeaseLost", "Limits", "Message", "PagedqError", "StreamEvent", "Timings", "Usage",
]
