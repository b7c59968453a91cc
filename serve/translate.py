"""OpenAI request bodies -> JobRequests. A field pagedq cannot honour is refused with a 400 that names it:
a client that asks for something pagedq does not do (tool_choice "auto", say) learns so at once, instead of getting
something else silently.

`response_format` (text, json_object, json_schema) and vLLM's `guided_json`, `guided_regex`, `guided_choice` and
`guided_grammar` constrain the output; `tools` with a forced `tool_choice` too (serve.tools). A constraint the
grammar engine refuses (an invalid schema or regex, a grammar error) is a 400 naming the problem, before any job
is queued (serve.constraints: `parse` checks it, unless its caller checks it later, off the event loop).

Text that is not valid Unicode (a lone surrogate: JSON can spell "\\ud800", UTF-8 cannot hold it) is a 400 naming
where it is, wherever it is in the body.

A field sent as null counts as absent (the SDKs and many apps send nulls). Beyond OpenAI's fields, vLLM's
sampling extensions that the engine has are accepted too (`top_k`, `min_p`, `repetition_penalty`,
`ignore_eos`, `stop_token_ids`, and on both endpoints `best_of` and beam search: `use_beam_search`,
`length_penalty`, `early_stopping`, the width being `best_of` or else `n`), pagedq's `speculative` (false: the
job never speculates) and `priority`.

OpenAI's `service_tier` (on both endpoints) picks the job's lane: "auto"/"default" the API key's, "flex" the batch
lane, "priority" the interactive lane. `parse` only checks that it is one of those; what a key may ask for, and
the lane and group its job gets, are serve.lanes'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError

from producer import sampling_fields
from producer.protocol import JobRequest, lone_surrogate
from serve import constraints
from serve.errors import APIError, bad_request, unsupported
from serve.lanes import TIERS
from serve.tools import ToolCalls, parse_tools

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS)

CONSTRAINTS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")  # vLLM's, beside response_format
# Fields each endpoint maps onto a JobRequest (or reads itself); the sampling ones are producer.sampling_fields'.
_COMMON = {"model", "stream", "stream_options", "user", "priority", "response_format", "service_tier",
           *CONSTRAINTS, *sampling_fields.openai_names(chat=False)}
_CHAT = _COMMON | sampling_fields.openai_names(chat=True) | {
    "messages", "metadata", "safety_identifier", "prompt_cache_key", "store", "modalities", "tools", "tool_choice",
    "parallel_tool_calls"}
_COMPLETION = _COMMON | {"prompt", "echo", "suffix"}
# OpenAI fields pagedq does not do at all (named in the 400); any other unknown field is unrecognized.
_UNSUPPORTED = {"logit_bias": "", "functions": "no function calling", "function_call": "no function calling",
                "audio": "text only", "prediction": "", "reasoning_effort": "", "verbosity": "",
                "web_search_options": ""}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Fields a message may carry; tool_calls, function_call, audio and refusal only when empty (an SDK that sends
# back the assistant message it got includes them as null).
_MESSAGE_FIELDS = {"role", "content"}
_MESSAGE_EMPTY_OK = {"tool_calls", "function_call", "audio", "refusal", "annotations"}

Kind = Literal["chat", "completion"]


@dataclass
class Parsed:
    """One OpenAI request, as the job to run and what its answer must look like."""

    kind: Kind
    model: str
    request: JobRequest
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    tools: ToolCalls | None = None  # the output is a forced tool call
    constraint_param: str | None = None  # the field the request's constraint came from, named in its 400
    service_tier: str | None = None  # OpenAI's, as sent (one of serve.lanes.TIERS): serve.lanes picks the lane


def parse(kind: Kind, body: Any, job_id: str | None = None, default_max_tokens: int | None = None,
          check: bool = True) -> Parsed:
    """Raise APIError (400) naming the first field that is wrong or unsupported. `check`: compile the constraint
    now (False: the caller checks it later, serve.constraints.Checks)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    _check_unicode(body)
    body = {k: v for k, v in body.items() if v is not None}
    allowed = _CHAT if kind == "chat" else _COMPLETION
    for key in body:
        if key in allowed:
            continue
        if key in _UNSUPPORTED:
            raise unsupported(key, _UNSUPPORTED[key])
        raise bad_request(f"Unrecognized request argument supplied: {key}", key, "unrecognized_argument")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("you must give a model (a string)", "model")
    _check_neutral(kind, body)
    fields: dict[str, Any] = {"model": model}
    if job_id is not None:
        fields["id"] = job_id
    if kind == "chat":
        fields["messages"] = _messages(body.get("messages"))
    else:
        fields["prompt"] = _prompt(body.get("prompt"))
    for name in (*sampling_fields.COPIED, "priority", "response_format", *CONSTRAINTS):
        if name in body:
            fields[name] = body[name]
    tools = parse_tools(body) if kind == "chat" else None
    if tools is not None:
        given = [name for name in ("response_format", *CONSTRAINTS) if name in fields]
        if given and fields.get("response_format") != {"type": "text"}:
            raise bad_request(f"a forced tool_choice constrains the output already: drop {given[0]}", given[0])
        fields.pop("response_format", None)
        fields["guided_json"] = tools.schema
    max_param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_param in body:
        fields["max_tokens"] = body[max_param]
    elif kind == "completion":
        fields["max_tokens"] = 16  # OpenAI's default for completions
    elif default_max_tokens is not None:
        fields["max_tokens"] = default_max_tokens
    logprobs = _logprobs(kind, body)
    if logprobs is not None:
        fields["logprobs"] = logprobs
    fields["metadata"] = _metadata(body)
    tier = body.get("service_tier")
    if tier is not None and (not isinstance(tier, str) or tier not in TIERS):
        raise bad_request(f"service_tier must be one of {', '.join(TIERS)}", "service_tier")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
        raise unsupported("stream_options", "only include_usage")
    if options and not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    try:
        req = JobRequest(**fields)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = str(err["loc"][0]) if err["loc"] else None
        param = max_param if loc == "max_tokens" else loc
        raise bad_request(f"{param or 'request'}: {err['msg']}", param) from None
    param = None
    if req.constraint is not None:
        param = "tools" if tools is not None else next(n for n in ("response_format", *CONSTRAINTS) if n in body)
        if check:
            constraints.check_now(req.constraint, param)
    return Parsed(kind, model, req, stream, bool(options.get("include_usage")), logprobs is not None, tools, param,
                  tier)


def _check_unicode(body: dict) -> None:
    """A 400 naming the first string (or key) holding a lone surrogate: refused before any field is read, so that
    no error message quotes one back (it could not be encoded) and JobRequest never sees one."""
    found = lone_surrogate(body)
    if found is not None:
        where, char = found
        raise bad_request(f"{where}: text is not valid Unicode (a lone surrogate, U+{ord(char):04X}): send UTF-8 "
                          "text", where, "invalid_unicode")


def _check_neutral(kind: Kind, body: dict) -> None:
    """Fields that pagedq accepts only at their do-nothing value."""
    if kind == "completion":
        if body.get("echo", False):
            raise unsupported("echo")
        if body.get("suffix"):
            raise unsupported("suffix")
        return
    if body.get("modalities", ["text"]) != ["text"]:
        raise unsupported("modalities", "text only")
    if body.get("store", False):
        raise unsupported("store", "completions are not stored")


def _messages(raw: Any) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object", where)
        role = m.get("role")
        if role not in _ROLES:
            if role in ("tool", "function"):
                raise unsupported(f"{where}.role", f"no {role} messages")
            raise bad_request(f"{where}.role must be one of {', '.join(_ROLES)}", f"{where}.role")
        for key, value in m.items():
            if key in _MESSAGE_FIELDS or (key in _MESSAGE_EMPTY_OK and not value):
                continue
            raise unsupported(f"{where}.{key}")
        out.append({"role": _ROLES[role], "content": _content(m.get("content"), f"{where}.content")})
    return out


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise unsupported(f"{where}[{j}]", "text parts only")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_request(f"{where} must be a string or an array of text parts", where)


def _prompt(raw: Any) -> str:
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
        raw = raw[0]
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list) and len(raw) > 1 and all(isinstance(p, str) for p in raw):
        raise unsupported("prompt", "one prompt per request (send several requests, or a batch)")
    if isinstance(raw, list):
        raise unsupported("prompt", "text prompts only, not token ids")
    raise bad_request("prompt must be a string", "prompt")


def _logprobs(kind: Kind, body: dict) -> int | None:
    if kind == "completion":
        lp = body.get("logprobs")
        if lp is None or lp is False:
            return None
        if isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= 5:
            raise bad_request("logprobs must be an integer from 0 to 5", "logprobs")
        return lp
    top = body.get("top_logprobs")
    if not body.get("logprobs", False):
        if top:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        return None
    if top is None:
        return 0
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
        raise bad_request("top_logprobs must be an integer from 0 to 20", "top_logprobs")
    return top


def _metadata(body: dict) -> dict:
    meta = body.get("metadata") or {}
    if not isinstance(meta, dict):
        raise bad_request("metadata must be an object", "metadata")
    meta = dict(meta)
    for name in ("user", "safety_identifier"):
        if name in body:
            if not isinstance(body[name], str):
                raise bad_request(f"{name} must be a string", name)
            meta[name] = body[name]
    return meta


def endpoint_kind(url: str) -> Kind:
    if url == CHAT:
        return "chat"
    if url == COMPLETIONS:
        return "completion"
    raise APIError(400, f"endpoint {url!r} is not supported; pagedq serves {', '.join(ENDPOINTS)}", param="url")
