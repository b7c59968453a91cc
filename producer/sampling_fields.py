"""The sampling fields of a job, in one table: how generation draws its tokens, from the request to the engine.

JobRequest's sampling fields are made from it (producer.protocol), serve reads them from OpenAI bodies through it
(serve.translate) and the worker builds the engine's SamplingParams from it (worker.validate). Three places cannot
import it: the engine (below producer in the layers), the JavaScript client and PROTOCOL.md. They restate it, and
tests/queue/test_sampling_fields.py holds each to it: a field missing from one, or with another default or bound, fails
that test, naming the field and the place.

Adding a sampling field: a row here; the engine's SamplingParams (engine=True); clients/js (index.d.ts, and
src/request.js's defaults and checks); PROTOCOL.md's table. The test names whichever is missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import Field

# Bounds every worker can hold whatever its settings (protocol.Limits holds the configurable ones): each value fits
# the integer or float32 that the engine turns it into, so no arithmetic on it can overflow.
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_TEMPERATURE = 100.0  # far past the point where sampling is uniform; keeps logits / temperature finite
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0  # logits are multiplied or divided by it
MAX_LENGTH_PENALTY = 10.0  # beam search divides by length ** length_penalty, either sign

_SAME = object()  # engine_default: the engine's default is the job's


@dataclass(frozen=True)
class SamplingField:
    """One sampling field. Bounds apply to the value, or to each item of a list; None (where the type takes it)
    is always allowed."""

    name: str  # on the job (JobRequest), and on the engine's SamplingParams where `engine`
    type: Any  # the job's type, without the bounds
    default: Any  # the job's default; a list's is [] (a new empty list each time)
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    openai: tuple[str, ...] = ()  # names serve reads it from, on both endpoints; (name,): copied as it is
    chat: tuple[str, ...] = ()  # more names it is read from on /v1/chat/completions only
    engine: bool = True  # whether SamplingParams takes it, under the same name
    engine_default: Any = _SAME  # the engine's default, where it is not the job's

    @property
    def copied(self) -> bool:
        """Whether serve copies the OpenAI value onto the job as it is (else serve translates it itself)."""
        return self.openai == (self.name,) and not self.chat

    @property
    def bounds(self) -> dict[str, float]:
        return {k: v for k, v in (("ge", self.ge), ("gt", self.gt), ("le", self.le)) if v is not None}

    @property
    def default_in_engine(self) -> Any:
        return self.default if self.engine_default is _SAME else self.engine_default

    def annotation(self) -> Any:
        """The pydantic type of the job's field: bounds on the value, or on a list's items."""
        if get_origin(self.type) is list and self.bounds:
            (item,) = get_args(self.type)
            return list[Annotated[item, Field(**self.bounds)]]
        return self.type

    def field(self) -> Any:
        """The pydantic FieldInfo of the job's field."""
        if isinstance(self.default, list):  # a list's bounds are its items' (annotation)
            return Field(default_factory=list)
        return Field(default=self.default, **self.bounds)


def _f(name: str, type: Any, default: Any, *, openai: tuple[str, ...] | None = None, **kw: Any) -> SamplingField:
    return SamplingField(name, type, default, openai=(name,) if openai is None else openai, **kw)


# In JobRequest's order. OpenAI's names and ranges; top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids,
# best_of and beam search are vLLM's extensions.
SAMPLING: tuple[SamplingField, ...] = (
    # Past the model's context the output ends there ("length"); Limits.max_tokens bounds it at submit.
    # The engine's own default is vLLM's 16; serve gives completions OpenAI's 16 itself.
    _f("max_tokens", int, 256, ge=1, le=INT32_MAX, chat=("max_completion_tokens",), engine_default=16),
    _f("temperature", float, 1.0, ge=0, le=MAX_TEMPERATURE),  # 0: greedy
    _f("top_p", float, 1.0, gt=0, le=1),
    _f("top_k", int, 0, ge=-1, le=INT32_MAX),  # 0 or -1: off. Bounded: the sampler makes a tensor of it
    _f("min_p", float, 0.0, ge=0, le=1),
    _f("seed", int | None, None, ge=INT64_MIN, le=INT64_MAX),  # None: the worker derives one from the id
    _f("stop", list[str], []),  # a string is one stop string; None is none (JobRequest's validator)
    # Each below the model's vocabulary size too: the worker checks that, as only it knows the model.
    _f("stop_token_ids", list[int], [], ge=0, le=INT32_MAX),
    _f("ignore_eos", bool, False),
    # OpenAI's chat has logprobs: true and top_logprobs: N; its completions logprobs: N (serve translates both).
    _f("logprobs", int | None, None, ge=0, le=20, chat=("top_logprobs",)),
    _f("presence_penalty", float, 0.0, ge=-2, le=2),
    _f("frequency_penalty", float, 0.0, ge=-2, le=2),
    # vLLM's: > 1 discourages repeats, 1 is off.
    _f("repetition_penalty", float, 1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY),
    # Several continuations of the prompt, on shared KV blocks: n returned; best_of run and the n of highest
    # cumulative logprob returned; or beam search (greedy: temperature 0). Limits.max_n / max_width bound these,
    # and the worker refuses a width its batch or KV cache can never hold.
    _f("n", int, 1, ge=1, le=INT32_MAX),
    _f("best_of", int | None, None, ge=1, le=INT32_MAX),
    _f("use_beam_search", bool, False),
    # None: best_of, else n. Not on serve's endpoints: there the width is best_of, else n.
    _f("beam_width", int | None, None, ge=1, le=INT32_MAX, openai=()),
    _f("length_penalty", float, 1.0, ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY),
    _f("early_stopping", bool | Literal["never"], False),  # transformers' meaning
    # false: this job never speculates on a worker that does (--speculative). Its tokens are the same either way;
    # a job that measures its own step times, or a worker's operator, may want it plain.
    _f("speculative", bool, True),
)

BY_NAME: dict[str, SamplingField] = {f.name: f for f in SAMPLING}


def pydantic_fields() -> dict[str, tuple[Any, Any]]:
    """{name: (type, FieldInfo)} of the sampling fields, for pydantic's create_model."""
    return {f.name: (f.annotation(), f.field()) for f in SAMPLING}


def engine_kwargs(job: Any) -> dict[str, Any]:
    """The engine's SamplingParams keyword arguments of a job's sampling fields (lists copied)."""
    out = {}
    for f in SAMPLING:
        if f.engine:
            value = getattr(job, f.name)
            out[f.name] = list(value) if isinstance(value, list) else value
    return out


def openai_names(chat: bool) -> set[str]:
    """Every OpenAI body field that sets a sampling field, on chat completions or on completions."""
    return {name for f in SAMPLING for name in (*f.openai, *(f.chat if chat else ()))}


COPIED: tuple[str, ...] = tuple(f.name for f in SAMPLING if f.copied)  # serve copies these from an OpenAI body
