"""JobResults and stream events -> OpenAI's response objects: chat.completion, text_completion and their
streamed chunks.

The server has no tokenizer (it imports no model code), so a logprob names its token as `token_id:<id>`, the
form vLLM uses for the same case.
"""

from __future__ import annotations

import json
import time

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
    return {"index": index, "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": lps, "finish_reason": finish}


def finish_reason(res: JobResult | Choice) -> str:
    return _FINISH.get(res.finish_reason or "", "stop")


def choices_of(res: JobResult) -> list[JobResult | Choice]:
    """The job's continuations: its choices where it has several, else itself."""
    return list(res.choices) if res.choices else [res]


def completion(p: Parsed, res: JobResult) -> dict:
    """The whole answer of a finished job (status completed); usage counts every choice's tokens."""
    choices = [_choice(p, c.text, finish_reason(c), logprobs(p, c.logprobs), index=i)
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
        return b"".join(self._frame([_choice(self.p, "", None, None, {"role": "assistant", "content": ""}, i)])
                        for i in range(self.p.request.n))

    def text(self, text: str, lps: list[TokenLogprob] | None, index: int = 0) -> bytes:
        return self._frame([_choice(self.p, text, None, logprobs(self.p, lps), {"content": text}, index)])

    def last(self, res: JobResult) -> bytes:
        """Each choice's finish reason, then (when asked for) a chunk with no choices and the usage; then
        [DONE]."""
        out = b"".join(self._frame([_choice(self.p, "", finish_reason(c), None, {}, i)])
                       for i, c in enumerate(choices_of(res)))
        if self.p.include_usage:
            out += self._frame([], usage(res.usage))
        return out + DONE


def sse(body: dict) -> bytes:
    return f"data: {json.dumps(body, separators=(',', ':'), ensure_ascii=False)}\n\n".encode()


DONE = b"data: [DONE]\n\n"
