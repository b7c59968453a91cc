"""The wire protocol: what a producer enqueues, what a worker streams and stores. JSON only."""

from __future__ import annotations

import json
import re
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from producer import sampling_fields
from producer.keys import DEFAULT_LANE, GROUP_NAME_PATTERN, LANES
from producer.sampling_fields import INT32_MAX as INT32_MAX  # the bounds are the table's; named here too
from producer.sampling_fields import INT64_MAX as INT64_MAX
from producer.sampling_fields import INT64_MIN as INT64_MIN
from producer.sampling_fields import MAX_LENGTH_PENALTY as MAX_LENGTH_PENALTY
from producer.sampling_fields import MAX_REPETITION_PENALTY as MAX_REPETITION_PENALTY
from producer.sampling_fields import MAX_TEMPERATURE as MAX_TEMPERATURE
from producer.sampling_fields import MIN_REPETITION_PENALTY as MIN_REPETITION_PENALTY

JobStatus = Literal["queued", "running", "completed", "failed", "cancelled", "expired"]
FinishReason = Literal["stop", "length", "cancelled", "error", "expired"]
TERMINAL = ("completed", "failed", "cancelled", "expired")

_ID_RE = re.compile(r"^[\x21-\x7e]{1,200}$")  # printable ASCII without spaces: it becomes part of key names
_SURROGATE_RE = re.compile("[\ud800-\udfff]")  # a lone UTF-16 half: JSON can spell it, UTF-8 cannot hold it

MAX_TIMEOUT_S = 365 * 24 * 3600.0


def new_id() -> str:
    return uuid.uuid4().hex


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str = Field(min_length=1, max_length=64)
    content: str


class _JobHead(BaseModel):
    """A job's first fields: which job, which model, what prompt."""

    # NaN and infinity have no JSON form: refused here, not sent as null to mean something else.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    id: str = Field(default_factory=new_id)  # the idempotency key: a second submit with the same id is refused
    model: str | None = Field(default=None, max_length=256)  # None: whatever model the queue's workers serve
    prompt: str | None = None
    messages: list[Message] | None = None


# Then how its tokens are drawn: max_tokens to early_stopping, made from the one table of them.
_JobSampling = create_model("_JobSampling", __base__=_JobHead, **sampling_fields.pydantic_fields())


class JobRequest(_JobSampling):
    """One generation job. Field names and meanings follow OpenAI's completions / chat completions; the sampling
    fields (max_tokens ... early_stopping) are producer.sampling_fields' table."""

    # What the output must parse as, at most one of: OpenAI's response_format ({"type": "text" | "json_object" |
    # "json_schema", "json_schema": {"name", "schema", "strict"}}) or vLLM's guided_* fields. The worker masks
    # every token the constraint does not allow; the output ends where the constraint is complete.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | bool | None = None  # a JSON schema
    guided_regex: str | None = Field(default=None, min_length=1)
    guided_choice: list[Annotated[str, Field(min_length=1)]] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = Field(default=None, min_length=1)  # Lark, or GBNF / EBNF as llama.cpp writes it
    # The lane's stream it is queued on (read before the lanes below it), then within the worker's batch: lower
    # priority runs first, and a running job of a lower lane or priority is preempted for it when the batch is full.
    lane: Literal[LANES] = DEFAULT_LANE  # type: ignore[valid-type]
    priority: int = Field(default=0, ge=-INT32_MAX, le=INT32_MAX)  # lower runs first
    # The fair-share group (a tenant, a customer): a lane's groups share the workers by weight (`pagedq groups`).
    group: str | None = Field(default=None, pattern=GROUP_NAME_PATTERN)
    timeout_s: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT_S)  # from enqueue; past it the job expires
    metadata: dict[str, Any] = Field(default_factory=dict)  # opaque to the worker; echoed in the result

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        # A lone surrogate ("\\ud800" in JSON) passes as a Python str, then fails wherever the text is encoded: the
        # tokenizer, Redis, a response. Refused here, naming where it is.
        found = lone_surrogate(data)
        if found is not None:
            where, char = found
            raise ValueError(f"{where or 'request'}: text is not valid Unicode (a lone surrogate, U+{ord(char):04X}): "
                             f"send UTF-8 text")
        return data

    @field_validator("id", mode="before")
    @classmethod
    def _none_id(cls, v: Any) -> Any:
        return new_id() if v is None else v

    @field_validator("id")
    @classmethod
    def _check_id(cls, v: str) -> str:
        if not _ID_RE.match(v):
            raise ValueError("id must be 1-200 printable ASCII characters without spaces")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        if v is None:
            return []
        return [v] if isinstance(v, str) else v

    @field_validator("metadata")
    @classmethod
    def _plain_json(cls, v: dict[str, Any]) -> dict[str, Any]:
        # Any would take sets, bytes, NaN or a 10,000-deep nest, which fail later (at encoding, or in the
        # worker) with an error that does not say which field is wrong.
        try:
            json.dumps(v, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as e:
            raise ValueError(f"metadata must be plain JSON (objects, arrays, strings, finite numbers, true, "
                             f"false, null): {e}") from None
        return v

    @property
    def width(self) -> int:
        """Continuations the job runs at once (the engine's SamplingParams.width)."""
        if self.use_beam_search:
            return self.beam_width or self.best_of or self.n
        return self.best_of or self.n

    @property
    def several(self) -> bool:
        """Whether the job has several continuations: its token events say which (index), its result lists them."""
        return self.width > 1

    @field_validator("guided_json", mode="before")
    @classmethod
    def _schema_text(cls, v: Any) -> Any:
        # vLLM takes the schema as an object or as its JSON text.
        if isinstance(v, str):
            try:
                return json.loads(v)
            except ValueError as e:
                raise ValueError(f"guided_json is not valid JSON: {e}") from None
        return v

    @field_validator("response_format")
    @classmethod
    def _check_response_format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        kind = v.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError(f"response_format.type must be text, json_object or json_schema, got {kind!r}")
        extra = set(v) - ({"type", "json_schema"} if kind == "json_schema" else {"type"})
        if extra:
            raise ValueError(f"response_format of type {kind} does not take {', '.join(sorted(extra))}")
        if kind != "json_schema":
            return v
        spec = v.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ValueError("response_format.json_schema must be an object with a schema (and a name)")
        if not isinstance(spec["schema"], (dict, bool)):
            raise ValueError("response_format.json_schema.schema must be a JSON Schema object")
        unknown = set(spec) - {"name", "schema", "strict", "description"}
        if unknown:
            raise ValueError(f"response_format.json_schema does not take {', '.join(sorted(unknown))}")
        return v

    @property
    def constraint(self) -> tuple[str, Any] | None:
        """(kind, spec) of what the output must parse as (the engine's Constraint), or None."""
        fmt = self.response_format or {}
        if fmt.get("type") == "json_schema":
            return "json_schema", fmt["json_schema"]["schema"]
        if fmt.get("type") == "json_object":
            return "json_object", None
        for kind, spec in (("json_schema", self.guided_json), ("regex", self.guided_regex),
                           ("choice", self.guided_choice), ("grammar", self.guided_grammar)):
            if spec is not None:
                return kind, spec
        return None

    @model_validator(mode="after")
    def _one_constraint(self) -> JobRequest:
        given = [name for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
                 if getattr(self, name) is not None]
        if (self.response_format or {}).get("type", "text") != "text":
            given.insert(0, "response_format")
        if len(given) > 1:
            raise ValueError(f"give at most one constraint; got {', '.join(given)}")
        if given and self.use_beam_search:
            raise ValueError(f"beam search does not take a constraint ({given[0]}): sample instead")
        return self

    @model_validator(mode="after")
    def _prompt_xor_messages(self) -> JobRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt is empty")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty")
        return self


def lone_surrogate(value: Any) -> tuple[str, str] | None:
    """(the dotted path, the character) of the first lone surrogate in any string of `value`, keys included, or
    None. A walk with its own stack: a 5,000-deep nest is no reason to fail with anything but a clear error."""
    try:  # the usual case, in C rather than a walk in Python: UTF-8 holds every string of it
        json.dumps(value, ensure_ascii=False).encode()
        return None
    except (UnicodeEncodeError, TypeError, ValueError, RecursionError):  # one is there, or not plain JSON: walk
        pass
    todo: list[tuple[str, Any]] = [("", value)]
    while todo:
        path, v = todo.pop()
        if isinstance(v, str):
            found = _SURROGATE_RE.search(v)
            if found:
                return path, found.group()
        elif isinstance(v, dict):
            for k, item in reversed(list(v.items())):
                name = k.encode("utf-8", "backslashreplace").decode() if isinstance(k, str) else str(k)
                at = f"{path}.{name}" if path else name  # a key's surrogate spelled as JSON does: the path is text
                todo.append((at, item))
                todo.append((at, k))
        elif isinstance(v, (list, tuple)):
            todo.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(v))))
    return None


def metadata_bytes(metadata: dict[str, Any]) -> int:
    """The size the metadata limit counts: UTF-8 bytes of its compact JSON (one measure in every language)."""
    return len(json.dumps(metadata, separators=(",", ":"), ensure_ascii=False).encode())


class Limits(BaseModel):
    """Size limits, checked at submit and again by the worker (a producer may skip the client)."""

    max_prompt_chars: int = 1_000_000  # prompt, or all message contents together
    max_messages: int = 1024
    max_tokens: int = 32_768
    max_metadata_bytes: int = 16_384
    max_stop: int = 16
    max_stop_chars: int = 1_000  # each stop string: every new token's text is matched against them
    max_stop_token_ids: int = 256  # beam search ranks (1 + this) x beams candidates a step
    max_n: int = 16  # continuations returned
    max_width: int = 32  # continuations run at once: best_of, beam_width
    max_constraint_bytes: int = 65_536  # a schema, regex, grammar or the choices, as compact JSON

    def check(self, req: JobRequest) -> None:
        """Raise ValueError naming the first limit `req` exceeds."""
        chars = len(req.prompt) if req.prompt is not None else sum(len(m.content) for m in req.messages or [])
        if chars > self.max_prompt_chars:
            raise ValueError(f"prompt is {chars} characters, the limit is {self.max_prompt_chars}")
        if req.messages is not None and len(req.messages) > self.max_messages:
            raise ValueError(f"{len(req.messages)} messages, the limit is {self.max_messages}")
        if req.max_tokens > self.max_tokens:
            raise ValueError(f"max_tokens is {req.max_tokens}, the limit is {self.max_tokens}")
        if len(req.stop) > self.max_stop:
            raise ValueError(f"{len(req.stop)} stop strings, the limit is {self.max_stop}")
        longest = max(map(len, req.stop), default=0)
        if longest > self.max_stop_chars:
            raise ValueError(f"a stop string is {longest} characters, the limit is {self.max_stop_chars}")
        if len(req.stop_token_ids) > self.max_stop_token_ids:
            raise ValueError(f"{len(req.stop_token_ids)} stop_token_ids, the limit is {self.max_stop_token_ids}")
        if req.n > self.max_n:
            raise ValueError(f"n is {req.n}, the limit is {self.max_n}")
        if req.width > self.max_width:
            raise ValueError(f"{'beam_width' if req.use_beam_search else 'best_of'} is {req.width}, the limit is "
                             f"{self.max_width}")
        constraint = req.constraint
        if constraint is not None:
            size = metadata_bytes(constraint[1])
            if size > self.max_constraint_bytes:
                raise ValueError(f"the {constraint[0]} constraint is {size} bytes as JSON, the limit is "
                                 f"{self.max_constraint_bytes}")
        size = metadata_bytes(req.metadata)
        if size > self.max_metadata_bytes:
            raise ValueError(f"metadata is {size} bytes as JSON, the limit is {self.max_metadata_bytes}")


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class Timings(BaseModel):
    """Unix times in seconds. enqueued_at is the producer's clock; the others are the worker's."""

    enqueued_at: float | None = None
    started_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None


class ErrorInfo(BaseModel):
    type: str  # invalid_request | unknown_model | prompt_too_long | engine_error | ...
    message: str


class TokenLogprob(BaseModel):
    token_id: int
    logprob: float
    top: dict[int, float] = Field(default_factory=dict)


class Choice(BaseModel):
    """One continuation of a job with several (n > 1, best_of, beam search), in the order returned."""

    index: int
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None  # where the engine ranked by it: best_of, beam search


class JobResult(BaseModel):
    id: str
    status: JobStatus
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: Usage = Field(default_factory=Usage)
    timings: Timings = Field(default_factory=Timings)
    worker: str | None = None
    attempts: int = 0
    error: ErrorInfo | None = None
    model: str | None = None
    logprobs: list[TokenLogprob] | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    # A job with several continuations: every one, by index; text, token_ids, finish_reason and logprobs above are
    # choices[0]'s, and usage counts them all. None for a job with one.
    choices: list[Choice] | None = None


class StreamEvent(BaseModel):
    """One entry of a job's event stream: token chunks, then exactly one terminal event."""

    type: Literal["token", "done", "error", "cancelled"]
    text: str = ""  # token: the new text
    token_ids: list[int] = Field(default_factory=list)  # token: the new ids
    logprobs: list[TokenLogprob] | None = None
    index: int = 0  # token: which continuation, in a job with several (always 0 in a job with one)
    finish_reason: FinishReason | None = None  # token, in a job with several: this continuation ended here
    result: JobResult | None = None  # terminal events carry the final result
    event_id: str | None = Field(default=None, exclude=True)  # the stream entry id, to resume after it
    offset: int | None = Field(default=None, exclude=True)  # token: the job's output tokens before it (the entry's)

    @property
    def terminal(self) -> bool:
        return self.type != "token"


# The worker writes a terminal event as '{"type": ..., "result": <JobResult JSON>}' (see complete.lua): the
# result JSON is sent once and stored twice.
TERMINAL_EVENT = {"completed": "done", "failed": "error", "cancelled": "cancelled", "expired": "error"}
