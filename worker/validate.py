"""Turning a stream entry into an engine request, or into a clear error for its failed result."""

from __future__ import annotations

import hashlib
import json

from pydantic import ValidationError

from engine import Constraint, SamplingParams
from producer.protocol import JobRequest, Limits
from producer.sampling_fields import engine_kwargs
from producer.wire import ENTRY_JOB


class Rejected(Exception):
    """The job cannot run: `type` and `message` go into its failed result."""

    def __init__(self, type: str, message: str) -> None:
        super().__init__(message)
        self.type = type
        self.message = message


def parse(fields: dict, job_id: str, limits: Limits, served: set[str]) -> JobRequest:
    raw = fields.get(ENTRY_JOB)
    if raw is None:
        raise Rejected("invalid_request", f"stream entry has no {ENTRY_JOB!r} field holding the JobRequest JSON")
    try:
        req = JobRequest.model_validate_json(raw)
    except ValidationError as e:
        errs = e.errors(include_url=False)
        if not errs or errs[0]["type"] != "json_invalid":
            raise _invalid(errs) from None
        try:  # JSON that spells a lone surrogate ("\ud800") is JSON still: the request's text is what is wrong
            body = json.loads(raw)
        except (ValueError, RecursionError):
            raise Rejected("invalid_json", f"job is not valid JSON: {errs[0]['msg']}") from None
        try:
            req = JobRequest.model_validate(body)
        except ValidationError as again:
            raise _invalid(again.errors(include_url=False)) from None
    if req.id != job_id:
        if "id" in req.model_fields_set and json.loads(raw).get("id") is not None:
            raise Rejected("invalid_request", f"the JSON's id {req.id!r} differs from the entry's id {job_id!r}")
        # A producer that XADDs by hand may leave the id out of the JSON: the entry's id names the job.
        req = req.model_copy(update={"id": job_id})
    if req.model is not None and req.model not in served:
        raise Rejected("unknown_model",
                       f"model {req.model!r} is not served on this queue; this worker serves {sorted(served)}")
    try:
        limits.check(req)
    except ValueError as e:
        raise Rejected("limit_exceeded", str(e)) from None
    return req


def _invalid(errs: list) -> Rejected:
    parts = [f"{'.'.join(str(x) for x in err['loc']) or 'request'}: {err['msg']}" for err in errs]
    return Rejected("invalid_request", "; ".join(parts))


def job_seed(job_id: str) -> int:
    """The sampling seed of a job that gives none: fixed by its id, so that a job resumed on another worker
    draws exactly what an uninterrupted run would have."""
    return int.from_bytes(hashlib.sha256(job_id.encode()).digest()[:8], "big") >> 1


def sampling_params(req: JobRequest) -> SamplingParams:
    """The engine's parameters of a job: its sampling fields (producer.sampling_fields), its seed, or one fixed by
    its id, and its constraint."""
    params = engine_kwargs(req)
    if params["seed"] is None:
        params["seed"] = job_seed(req.id)
    try:
        return SamplingParams(**params, constraint=Constraint(*req.constraint) if req.constraint else None)
    except (ValueError, TypeError) as e:
        raise Rejected("invalid_request", str(e)) from None


def prompt_ids(req: JobRequest, engine) -> list[int]:
    """Token ids of the prompt: chat messages through the model's chat template. Checks the length."""
    try:
        if req.messages is not None:
            ids = engine.apply_chat_template([m.model_dump() for m in req.messages])
        else:
            ids = engine.tokenizer.encode(req.prompt)
    except ValueError as e:
        raise Rejected("invalid_request", str(e)) from None
    except Exception as e:  # a template that raises on odd roles, say: the job's fault, not the worker's
        raise Rejected("invalid_request", f"could not build the prompt: {type(e).__name__}: {e}") from None
    if not ids:
        raise Rejected("invalid_request", "prompt encodes to no tokens")
    if len(ids) >= engine.max_model_len:
        raise Rejected("prompt_too_long",
                       f"prompt is {len(ids)} tokens; model {engine.model_name!r} takes at most "
                       f"{engine.max_model_len} tokens in all (prompt + output), so at most "
                       f"{engine.max_model_len - 1} prompt tokens")
    return ids
