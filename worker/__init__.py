"""pagedq's worker: the process that bridges a Redis queue and the engine, with its publisher, heartbeat and
Prometheus metrics."""

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # the worker's processes log alike
