"""The installed pagedq version: `pagedq --version` and every worker's heartbeat show it."""

from __future__ import annotations


def pagedq_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pagedq")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"
