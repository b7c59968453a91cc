"""A batch's lines: the input JSONL -> one item per request (its job, or why it cannot run), and each item's
line of the output or error file, in OpenAI's formats."""

from __future__ import annotations

import json
from dataclasses import dataclass

from producer.protocol import JobRequest, JobResult
from serve import responses
from serve.config import ServeConfig
from serve.errors import APIError, from_result
from serve.translate import Kind, Parsed, parse


@dataclass
class Item:
    """One line: `request` and `queue` when it runs, else `error` ({code, message})."""

    custom_id: str | None
    request: JobRequest | None = None
    queue: str | None = None
    logprobs: bool = False
    error: dict | None = None

    def to_json(self) -> str:
        if self.request is None:
            return json.dumps({"custom_id": self.custom_id, "error": self.error})
        return json.dumps({"custom_id": self.custom_id, "queue": self.queue, "logprobs": self.logprobs,
                           "request": self.request.model_dump(mode="json", exclude_defaults=True) |
                           {"id": self.request.id}})

    @classmethod
    def from_json(cls, raw: str) -> Item:
        d = json.loads(raw)
        if "error" in d:
            return cls(d["custom_id"], error=d["error"])
        return cls(d["custom_id"], JobRequest.model_validate(d["request"]), d["queue"], d["logprobs"])


def read_items(text: str, endpoint: str, kind: Kind, batch_id: str, config: ServeConfig, timeout_s: float
               ) -> list[Item]:
    """One item per non-blank line; line i's job id is `<batch id>-<i>`, so that submitting again (a process
    that resumes a batch another one began) makes no second job."""
    items: list[Item] = []
    seen: set[str] = set()
    for line in (s for s in text.splitlines() if s.strip()):
        items.append(_item(line, endpoint, kind, f"{batch_id}-{len(items)}", config, timeout_s, seen))
    return items


def _item(line: str, endpoint: str, kind: Kind, job_id: str, config: ServeConfig, timeout_s: float,
          seen: set[str]) -> Item:
    try:
        d = json.loads(line)
    except ValueError as e:
        return Item(None, error={"code": "invalid_json", "message": f"line is not JSON: {e}"})
    if not isinstance(d, dict):
        return Item(None, error={"code": "invalid_request", "message": "line is not a JSON object"})
    cid = d.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return Item(None, error={"code": "missing_custom_id", "message": "custom_id must be a non-empty string"})
    if cid in seen:
        return Item(cid, error={"code": "duplicate_custom_id", "message": f"custom_id {cid!r} is used twice"})
    seen.add(cid)
    if d.get("method", "POST") != "POST":
        return Item(cid, error={"code": "invalid_method", "message": "method must be POST"})
    if d.get("url") != endpoint:
        return Item(cid, error={"code": "invalid_url",
                                "message": f"url is {d.get('url')!r}; this batch's endpoint is {endpoint}"})
    body = d.get("body")
    try:
        if isinstance(body, dict) and body.get("stream"):
            raise APIError(400, "stream is not allowed in a batch", param="stream")
        p = parse(kind, body, job_id, config.default_max_tokens)
        if not config.known(p.model):
            raise APIError(404, f"The model `{p.model}` is not served here", param="model", code="model_not_found")
    except APIError as e:
        return Item(cid, error={"code": e.code or e.type, "message": e.message, "param": e.param})
    extra = {"timeout_s": timeout_s}  # a job still queued when the window closes expires by itself
    if "priority" not in body:
        extra["priority"] = config.batch_priority
    req = p.request.model_copy(update=extra)
    return Item(cid, req, config.queue_of(p.model), p.logprobs)


def output_line(item: Item, line_id: str, kind: Kind, res: JobResult | None) -> tuple[bool, str]:
    """(True, the output file's line) for a completed job; (False, the error file's line) otherwise. `line_id`
    is `<batch id>-<line number>`, its job's id when it has one."""
    rid = item.request.id if item.request else None
    line: dict = {"id": f"batch_req_{line_id}", "custom_id": item.custom_id, "response": None, "error": None}
    if item.error is not None:
        line["error"] = {"code": item.error.get("code"), "message": item.error.get("message")}
    elif res is None:
        line["error"] = {"code": "result_expired", "message": f"job {rid} has no result in Redis any more"}
    elif res.status == "completed":
        p = Parsed(kind, item.request.model or "", item.request, logprobs=item.logprobs)
        line["response"] = {"status_code": 200, "request_id": rid, "body": responses.completion(p, res)}
        return True, json.dumps(line, ensure_ascii=False)
    elif res.status in ("cancelled", "expired"):
        code = "batch_cancelled" if res.status == "cancelled" else "batch_expired"
        line["error"] = {"code": code, "message": f"the request {res.status} before it ran to its end"}
    else:
        err = from_result(res)
        line["response"] = {"status_code": err.status, "request_id": rid, "body": err.body()}
    return False, json.dumps(line, ensure_ascii=False)
