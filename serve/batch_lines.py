"""A batch's lines: the input JSONL -> one item per request (its job, or why it cannot run), and each item's
line of the output or error file, in OpenAI's formats.

Reading lines is CPU work (JSON, the request's checks, a constraint's grammar): serve.batch_intake has it done in
serve.cpu_process's process (read_chunk), a chunk at a time, where holding the GIL stalls no stream. A line is checked as the live routes check a request (serve.translate.parse,
the size limits of producer.protocol.Limits) and whatever is wrong with it becomes its error line; nothing one
line holds stops the others.

Every line's job runs in the batch lane, in its API key's fair-share group, at `--batch-priority` unless it sends
a priority its key allows (serve.lanes: a line asking for more, or for service_tier "priority", is a line error).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass, field

from producer.protocol import JobRequest, JobResult, Limits, lone_surrogate
from serve import lanes, responses
from serve.check_budget import CheckBudget
from serve.config import ServeConfig
from serve.errors import APIError, from_result
from serve.translate import CONSTRAINTS, Kind, Parsed, endpoint_kind, parse

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_CONSTRAINED = {"response_format", "tools", *CONSTRAINTS}  # fields whose check may compile a grammar
READERS_KEPT = 16  # batches whose readers the reading process keeps between their chunks


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


def request_lines(text: str) -> list[str]:
    """The file's non-blank lines. Split on newlines only, as JSONL is: JSON text may hold U+2028 and the other
    separators str.splitlines() would cut at."""
    return [line for line in text.split("\n") if line.strip()]


@dataclass
class Chunk:
    """What reading some lines gave: each line's item as stored (line number -> JSON), the lines that run a job,
    their queues, and how many lines cannot run."""

    items: dict[str, str] = field(default_factory=dict)
    jobs: list[str] = field(default_factory=list)
    queues: set[str] = field(default_factory=set)
    errors: int = 0


class LineReader:
    """Reads one batch's lines into items, a chunk at a time, remembering the custom_ids seen. Line i's job id is
    `<batch id>-<i>`, so that submitting again (a process that resumes a batch another began) makes no second
    job."""

    def __init__(self, batch_id: str, endpoint: str, config: ServeConfig, timeout_s: float,
                 limits: Limits | None = None, group: str | None = None, top_priority: int | None = None) -> None:
        self.batch_id = batch_id
        self.endpoint = endpoint
        self.kind: Kind = endpoint_kind(endpoint)
        self.config = config
        self.timeout_s = timeout_s  # a job still queued when the window closes expires by itself
        self.limits = limits or Limits()  # the live routes' (their AsyncClients' default), which workers enforce
        self.group = group  # the batch's key's id (None without keys): its jobs' fair-share group
        self.top_priority = top_priority  # the most urgent priority its lines may ask for; None: any
        self.seen: set[str] = set()
        self.budget = CheckBudget(config.constraint_check_s)  # the live routes' budget too

    def read(self, lines: list[str], first: int) -> Chunk:
        """Lines `first`, `first` + 1, ... of the file."""
        out = Chunk()
        for i, line in enumerate(lines, first):
            try:
                it = self.item(line, f"{self.batch_id}-{i}")
                out.items[str(i)] = it.to_json()
            except RecursionError:  # JSON nested deeper than Python's stack: that line's fault alone
                it = Item(None, error={"code": "invalid_json", "message": "line nests too deep to be read"})
                out.items[str(i)] = it.to_json()
            if it.request is None:
                out.errors += 1
            else:
                out.jobs.append(str(i))
                out.queues.add(it.queue)
        return out

    def close(self) -> None:
        self.budget.close()

    def item(self, line: str, job_id: str) -> Item:
        try:
            d = json.loads(line)
        except ValueError as e:
            return Item(None, error={"code": "invalid_json", "message": f"line is not JSON: {e}"})
        if not isinstance(d, dict):
            return Item(None, error={"code": "invalid_request", "message": "line is not a JSON object"})
        cid = d.get("custom_id")
        # The file is UTF-8, so a lone surrogate can only come from a JSON escape: most lines need no walk.
        found = lone_surrogate(d) if _SURROGATE_ESCAPE.search(line) else None
        if found is not None:
            # Nothing of such a line may reach Redis or a response as it is: UTF-8 cannot hold it.
            where, char = found
            return Item(_printable(cid) if isinstance(cid, str) else None,
                        error={"code": "invalid_unicode", "message": f"{_printable(where) or 'line'}: text is not "
                               f"valid Unicode (a lone surrogate, U+{ord(char):04X}): send UTF-8 text"})
        if not isinstance(cid, str) or not cid:
            return Item(None, error={"code": "missing_custom_id", "message": "custom_id must be a non-empty string"})
        if cid in self.seen:
            return Item(cid, error={"code": "duplicate_custom_id", "message": f"custom_id {cid!r} is used twice"})
        self.seen.add(cid)
        if d.get("method", "POST") != "POST":
            return Item(cid, error={"code": "invalid_method", "message": "method must be POST"})
        if d.get("url") != self.endpoint:
            return Item(cid, error={"code": "invalid_url",
                                    "message": f"url is {d.get('url')!r}; this batch's endpoint is {self.endpoint}"})
        return self._request(cid, d.get("body"), job_id)

    def _request(self, cid: str, body: object, job_id: str) -> Item:
        try:
            if isinstance(body, dict) and body.get("stream"):
                raise APIError(400, "stream is not allowed in a batch", param="stream")
            p = self._parse(body, job_id)
            if not self.config.known(p.model):
                raise APIError(404, f"The model `{p.model}` is not served here", param="model",
                               code="model_not_found")
            self.limits.check(p.request)
            req = lanes.batch_line(p.request, p.service_tier, self.top_priority, self.group,
                                   self.config.batch_priority)
        except APIError as e:
            return Item(cid, error={"code": e.code or e.type, "message": e.message, "param": e.param})
        except TimeoutError as e:
            return Item(cid, error={"code": "constraint_timeout", "message": f"the constraint was not checked: {e}"})
        except ValueError as e:  # a size limit
            return Item(cid, error={"code": "limit_exceeded", "message": str(e)})
        return Item(cid, req.model_copy(update={"timeout_s": self.timeout_s}), self.config.queue_of(p.model),
                    p.logprobs)

    def _parse(self, body: object, job_id: str) -> Parsed:
        args = (self.kind, body, job_id, self.config.default_max_tokens)
        if isinstance(body, dict) and _CONSTRAINED & body.keys():
            return self.budget.run(parse, *args)
        return parse(*args)


def _printable(text: str) -> str:
    """`text` with lone surrogates written as escapes (\\ud800), so that it can be stored and shown."""
    return text.encode("utf-8", "backslashreplace").decode()


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


def output_lines(batch_id: str, kind: Kind, first: int, raw_items: list[str | None], raw_results: list[str | None]
                 ) -> tuple[bytes, bytes]:
    """The output file's and the error file's text (UTF-8) for lines `first`, `first` + 1, ... as stored: each
    line's item and its job's result (None: none)."""
    good, bad = [], []
    for i, (raw, result) in enumerate(zip(raw_items, raw_results, strict=True), first):
        if raw is None:  # the batch expired meanwhile
            continue
        try:
            res = JobResult.model_validate_json(result) if result else None
            ok, text = output_line(Item.from_json(raw), f"{batch_id}-{i}", kind, res)
        except Exception as e:  # one line that cannot be written must not keep the batch from its end
            ok, text = False, json.dumps({"id": f"batch_req_{batch_id}-{i}", "custom_id": None, "response": None,
                                          "error": {"code": "output_error", "message": f"{type(e).__name__}: {e}"}})
        (good if ok else bad).append(text + "\n")
    return "".join(good).encode(), "".join(bad).encode()


# ---- in the reading process (serve.cpu_process) -------------------------------------------------------------------

_readers: OrderedDict[str, LineReader] = OrderedDict()  # each batch's, across its chunks (the custom_ids it saw)


def read_chunk(batch_id: str, endpoint: str, config: ServeConfig, timeout_s: float,
               allowance: tuple[str | None, int | None], lines: list[str], first: int) -> Chunk:
    """LineReader.read of the batch's reader, made at its first chunk; `allowance`: its key's id (the jobs'
    group) and top_priority, (None, None) without keys."""
    group, top = allowance
    reader = _readers.pop(batch_id, None) or LineReader(batch_id, endpoint, config, timeout_s, group=group,
                                                        top_priority=top)
    _readers[batch_id] = reader
    while len(_readers) > READERS_KEPT:
        _readers.popitem(last=False)[1].close()
    return reader.read(lines, first)


def forget_reader(batch_id: str) -> None:
    """The batch's lines are all read."""
    reader = _readers.pop(batch_id, None)
    if reader is not None:
        reader.close()
