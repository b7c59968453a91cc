"""Errors a client raises."""

from __future__ import annotations


class PagedqError(Exception):
    pass


class DuplicateJobError(PagedqError):
    """A job with this id exists already. `ids` lists the refused ids; `jobs` the ones that were submitted
    (submit_many submits every other job of the batch)."""

    def __init__(self, message: str, ids: list[str], jobs: list | None = None) -> None:
        super().__init__(message)
        self.ids = ids
        self.jobs = jobs or []


class JobNotFound(PagedqError):
    pass


class LeaseLost(PagedqError):
    """A worker wrote to a job it no longer holds."""


class OwnerFull(PagedqError):
    """The API key that submits a job has as many jobs queued or running on the queue as it may (submit.lua)."""
