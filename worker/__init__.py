"""pagedq's worker: bridges a Redis queue and the engine; the `pagedq` CLI."""
