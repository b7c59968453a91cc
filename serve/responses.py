"""JobResults and stream events -> OpenAI's response objects: chat.completion, text_completion and their
streamed chunks.

The server has no tokenizer (it imports no model code), so a logprob names its token as `token_id:<id>`, the
form vLLM uses for the same case.
"""

from __future__ import annotations

import json
import time
from typing import Any

from producer.protocol import Choice, JobResult, TokenLogprob, Usage
from serve.translate import Parsed

_FINISH = {"stop": "stop", "length": "length"}


def response_id(p: Parsed) -> str:
    return f"{'chatcmpl' if p.kind == 'chat' else 'cmpl'}-{p.request.id}"


def usage(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def _token(token_id: int) -> str:
    return f"token_id:{token_id}"


def logprobs(p: Parsed, lps: list[TokenLogprob] | None) -> dict | None:
    if not p.logprobs or lps is None:
        return None
    if p.kind == "chat":
        return {"content": [{"token": _token(t.token_id), "logprob": t.logprob, "bytes": None,
                             "top_logprobs": [{"token": _token(i), "logprob": v, "bytes": None}
                                              for i, v in t.top.items()]} for t in lps],
                "refusal": None}
    return {"tokens": [_token(t.token_id) for t in lps], "token_logprobs": [t.logprob for t in lps],
            "top_logprobs": [{_token(i): v for i, v in t.top.items()} for t in lps], "text_offset": None}


def _choice(p: Parsed, text: str, finish: str | None, lps: dict | None, delta: dict | None = None,
            index: int = 0) -> dict:
    if p.kind == "completion":
        return {"index": index, "text": text, "logprobs": lps, "finish_reason": finish}
    if delta is not None:
        return {"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish}
    message = {"role": "assistant", "content": text, "refusal": None}
    if p.tools is not None:
        message.update(content=None, tool_calls=p.tools.calls(text, p.request.id, index))
    return {"index": index, "message": message, "logprobs": lps, "finish_reason": finish}


def finish_reason(res: JobResult | Choice, p: Parsed | None = None) -> str:
    reason = _FINISH.get(res.finish_reason or "", "stop")
    # A forced tool call that ran to its end is a call; one cut by max_tokens stays "length", as OpenAI's.
    return "tool_calls" if reason == "stop" and p is not None and p.tools is not None else reason


def choices_of(res: JobResult) -> list[JobResult | Choice]:
    """The job's continuations: its choices where it has several, else itself."""
    return list(res.choices) if res.choices else [res]


def completion(p: Parsed, res: JobResult) -> dict:
    """The whole answer of a finished job (status completed); usage counts every choice's tokens."""
    choices = [_choice(p, c.text, finish_reason(c, p), logprobs(p, c.logprobs), index=i)
               for i, c in enumerate(choices_of(res))]
    return {"id": response_id(p), "object": "chat.completion" if p.kind == "chat" else "text_completion",
            "created": int(res.timings.enqueued_at or time.time()), "model": p.model,
            "choices": choices, "usage": usage(res.usage), "system_fingerprint": None}


class Chunks:
    """The streamed chunks of one answer, as SSE `data:` lines."""

    def __init__(self, p: Parsed) -> None:
        self.p = p
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if p.kind == "chat" else "text_completion"

    def _frame(self, choices: list[dict], usage_: dict | None = None) -> bytes:
        body = {"id": response_id(self.p), "object": self.object, "created": self.created, "model": self.p.model,
                "choices": choices, "system_fingerprint": None}
        if self.p.include_usage:
            body["usage"] = usage_
        return sse(body)

    def first(self) -> bytes:
        """Chat opens each choice with the assistant's role and no text yet; completions have no such chunk."""
        if self.p.kind != "chat":
            return b""
        return b"".join(self._frame([_choice(self.p, "", None, None, self._opening(i), i)])
                        for i in range(self.p.request.n))

    def _opening(self, index: int) -> dict:
        tools = self.p.tools
        if tools is None:
            return {"role": "assistant", "content": ""}
        if not tools.streams_arguments:
            return {"role": "assistant", "content": None}
        opened = tools.calls("", self.p.request.id, index)[0]
        return {"role": "assistant", "content": None, "tool_calls": [{"index": 0, **opened}]}

    def text(self, text: str, lps: list[TokenLogprob] | None, index: int = 0) -> bytes:
        tools = self.p.tools
        if tools is None:
            delta = {"content": text}
        elif tools.streams_arguments:  # the named call's arguments, as they come
            delta = {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
        else:  # a "required" array becomes its calls at the end (last)
            return b""
        return self._frame([_choice(self.p, text, None, logprobs(self.p, lps), delta, index)])

    def last(self, res: JobResult) -> bytes:
        """Each choice's finish reason, then (when asked for) a chunk with no choices and the usage; then
        [DONE]."""
        out = b""
        tools = self.p.tools
        if tools is not None and not tools.streams_arguments:
            for i, c in enumerate(choices_of(res)):
                calls = [{"index": k, **call} for k, call in enumerate(tools.calls(c.text, self.p.request.id, i))]
                out += self._frame([_choice(self.p, "", None, None, {"tool_calls": calls}, i)])
        out += b"".join(self._frame([_choice(self.p, "", finish_reason(c, self.p), None, {}, i)])
                        for i, c in enumerate(choices_of(res)))
        if self.p.include_usage:
            out += self._frame([], usage(res.usage))
        return out + DONE


def dumps(body: Any, allow_nan: bool = True) -> bytes:
    """Compact JSON in UTF-8; text that UTF-8 cannot hold (a lone surrogate, in an error quoting a request, say)
    goes out escaped, never as a 500."""
    try:
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False, allow_nan=allow_nan).encode()
    except UnicodeEncodeError:
        return json.dumps(body, separators=(",", ":"), allow_nan=allow_nan).encode()


def sse(body: dict) -> bytes:
    return b"data: " + dumps(body) + b"\n\n"


DONE = b"data: [DONE]\n\n"
