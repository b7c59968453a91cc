"""pagedq's worker: bridges a Redis queue and the engine; the `pagedq` CLI."""

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # the worker's processes log alike
