"""What the commands share: the Redis and queue options, and the defaults of the rest, read from the settings
they fill (EngineConfig, WorkerConfig, ServeConfig, Limits) so that no default is written twice."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import click

from producer import defaults


def default_of(config: type, name: str) -> Any:
    """The default of field `name` of a settings class: a dataclass or a pydantic model."""
    if dataclasses.is_dataclass(config):
        return next(f.default for f in dataclasses.fields(config) if f.name == name)
    return config.model_fields[name].default


def queue_options(f):
    @click.option("--redis-url", envvar=["PAGEDQ_REDIS_URL", "REDIS_URL"], default=defaults.REDIS_URL, show_default=True,
                  help="Redis to use (any node's URL of a Redis Cluster)")
    @click.option("--queue", envvar="PAGEDQ_QUEUE", default=defaults.QUEUE, show_default=True, help="Queue name")
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        return f(*args, **kwargs)

    return wrapper
