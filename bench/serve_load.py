"""The serve-load workload (issue 30): many concurrent streams through one `pagedq serve` process, against the same
jobs followed straight from Redis by the producer's AsyncClient (the direct path: a connection per waiting stream).

Two workers serve a one-layer random model (bench.overhead.micro_model: the forward is nearly free, so what is
measured is the queue and the front, not the model). Each stream asks for TOKENS tokens of a short prompt. Every
request must end with its whole text, or with 429 and Retry-After (a refusal counts against the success rate only
without Retry-After). Reported: success rate; TTFT and end-to-end p50/p99 on both paths and their ratio (target:
serve's p99 within 1.2x of the direct path's); the most Redis connections the serve process held (CLIENT LIST, by
the names it gives them) beside the direct path's; serve's CPU seconds per 1,000 tokens streamed (/proc).

The load generator runs in this process, on the same cores as serve, the workers and Redis: on a small machine its
own work weighs on both paths' latencies alike.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from bench.harness import Process, start_logged

STREAMS = 2000
QUICK_STREAMS = 64
TOKENS = 16
WORKERS = 2
SERVE_CONNECTIONS = 16  # --redis-connections of the serve process
TARGET_P99_RATIO = 1.2
QUEUE = "serve-load"
MODEL = "micro"  # the name the workers serve the micro model under


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def _stats(ttft: list[float], e2e: list[float]) -> dict:
    return {"ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "e2e_p50_s": pct(e2e, 50),
            "e2e_p99_s": pct(e2e, 99)}


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Connections(threading.Thread):
    """The most connections Redis held at once while the load ran: all of them, and those named `names`."""

    def __init__(self, url: str, names: tuple[str, ...] = ()) -> None:
        import redis

        super().__init__(daemon=True)
        self.r = redis.Redis.from_url(url, decode_responses=True)
        self.names = names
        self.done = threading.Event()
        self.total = self.named = 0

    def run(self) -> None:
        while True:
            self._sample()
            if self.done.wait(0.25):
                return

    def _sample(self) -> None:
        # INFO's count where no names are asked: CLIENT LIST of 2,000 clients, parsed every 0.25 s, would take CPU
        # from the very path it counts.
        if not self.names:
            self.total = max(self.total, int(self.r.info("clients")["connected_clients"]))
            return
        clients = self.r.client_list()
        self.total = max(self.total, len(clients))
        self.named = max(self.named, sum(c.get("name") in self.names for c in clients))

    def __enter__(self) -> _Connections:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.join()
        self._sample()  # once more at the end: a short run may finish between two samples
        self.r.close()


def _prompt(tag: str, i: int) -> str:
    return f"{tag} stream {i}: a few words to start from"


async def _direct(url: str, n: int, tag: str) -> dict:
    """n streams followed straight from Redis: submit, then the job's event stream, each on its own connection."""
    import redis.asyncio as aredis

    from producer import AsyncClient

    async def one(client: AsyncClient, i: int) -> tuple[str, float | None, float]:
        sent = time.perf_counter()
        first, tokens, ok = None, 0, False
        try:
            job = await client.submit(model=MODEL, prompt=_prompt(tag, i), max_tokens=TOKENS, temperature=0,
                                      ignore_eos=True)
            async for ev in job.stream():
                if ev.type == "token":
                    first = first or time.perf_counter()
                    tokens += len(ev.token_ids)
                elif ev.terminal:
                    ok = ev.type == "done" and tokens == TOKENS
        except Exception as e:  # counted, not fatal: the direct path's own failures are part of its figures
            return f"{type(e).__name__}: {e}"[:120], None, 0.0
        return ("ok" if ok else "short"), None if first is None else first - sent, time.perf_counter() - sent

    # A connection per waiting stream: redis-py's default pool (100) would refuse the rest.
    redis = aredis.Redis.from_url(url, decode_responses=True, max_connections=n + 16)
    async with AsyncClient(queue=QUEUE, redis=redis) as client:
        start = time.perf_counter()
        outs = await asyncio.gather(*(one(client, i) for i in range(n)))
        elapsed = time.perf_counter() - start
    good = [o for o in outs if o[0] == "ok"]
    failures: dict[str, int] = {}
    for o in outs:
        if o[0] != "ok":
            failures[o[0]] = failures.get(o[0], 0) + 1
    return {"requests": n, "completed": len(good), "refused_with_retry_after": 0, "failed": n - len(good),
            "failures": failures, "elapsed_s": elapsed, **_stats([o[1] for o in good if o[1] is not None], [o[2] for o in good])}


class _Refused(Exception):
    """The server answered other than 200: the status, and whether it said when to retry."""

    def __init__(self, status: int, retry_after: bool) -> None:
        super().__init__(f"status {status}")
        self.status, self.retry_after = status, retry_after


async def _post_events(base: str, path: str, body: dict) -> AsyncIterator[str]:
    """The `data:` payloads of an SSE response to a JSON POST, over a connection of its own (HTTP/1.1, chunked).

    The load generator shares the cores with the server it measures, so it must cost little per token. httpx's
    connection pool scans every connection for each request (quadratic in 2,000 streams) and parses each line in
    Python layers: it took more CPU than the server. This is the least an HTTP client can do: one write, then
    chunks read and split on blank lines."""
    host, _, port = base.removeprefix("http://").partition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        payload = json.dumps(body).encode()
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
        status = int(head.split(" ", 2)[1])
        if status != 200:
            raise _Refused(status, "\r\nretry-after:" in head)
        pending = b""
        while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
            pending += (await reader.readexactly(size + 2))[:-2]
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if event.startswith(b"data: "):
                    yield event[6:].decode()
    finally:
        writer.close()


async def _served(base: str, n: int, tag: str) -> dict:
    """n streams through the serve process: POST /v1/completions with stream=true, read to [DONE]."""

    async def one(i: int) -> tuple[str, float | None, float]:
        body = {"model": MODEL, "prompt": _prompt(tag, i), "max_tokens": TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        sent = time.perf_counter()
        first, usage, done = None, None, False
        try:
            async for data in _post_events(base, "/v1/completions", body):
                if data == "[DONE]":
                    done = True
                    continue
                chunk = json.loads(data)
                if chunk.get("choices") and first is None:
                    first = time.perf_counter()
                usage = chunk.get("usage") or usage
                if "error" in chunk:
                    return f"error {chunk['error'].get('code')}", None, 0.0
        except _Refused as e:
            return ("refused" if e.status == 429 and e.retry_after else str(e)), None, 0.0
        except (OSError, ValueError, asyncio.IncompleteReadError) as e:
            return f"{type(e).__name__}", None, 0.0
        ok = done and usage is not None and usage["completion_tokens"] == TOKENS
        return ("ok" if ok else "short"), None if first is None else first - sent, time.perf_counter() - sent

    start = time.perf_counter()
    outs = await asyncio.gather(*(one(i) for i in range(n)))
    elapsed = time.perf_counter() - start
    good = [o for o in outs if o[0] == "ok"]
    refused = sum(o[0] == "refused" for o in outs)
    failures: dict[str, int] = {}
    for o in outs:
        if o[0] not in ("ok", "refused"):
            failures[o[0]] = failures.get(o[0], 0) + 1
    return {"requests": n, "completed": len(good), "refused_with_retry_after": refused,
            "failed": n - len(good) - refused, "failures": failures, "elapsed_s": elapsed,
            **_stats([o[1] for o in good if o[1] is not None], [o[2] for o in good])}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else b / a


def run_serve_load(device: str, quick: bool, streams: int | None = None, out_dir: str = "bench/results",
                   echo: Callable[[str], None] = print) -> dict:
    """Run the workload; write serve-load.json to `out_dir` and return its figures."""
    from bench import report
    from bench.overhead import micro_model
    from producer import Client
    from serve.events import READER_NAME
    from serve.queues import CLIENT_NAME
    from worker.redis_server import RedisServer, free_port

    n = streams or (QUICK_STREAMS if quick else STREAMS)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = micro_model()
    procs: list[Process] = []
    with RedisServer() as srv:
        try:
            for w in range(WORKERS):
                procs.append(start_logged([sys.executable, "-m", "cli", "worker", "--redis-url", srv.url, "--queue", QUEUE,
                                     "--model", model, "--device", device, "--max-num-seqs", "512",
                                     "--num-kv-blocks", "4096", "--max-model-len", "128", "--served-model-name", MODEL,
                                     "--log-level", "WARNING"],
                                    out / f"serve-load-worker-{w}.log"))
            port = free_port()
            base = f"http://127.0.0.1:{port}"
            serve_log = out / "serve-load-serve.log"
            serve = start_logged([sys.executable, "-m", "cli", "serve", "--redis-url", srv.url, "--queue", QUEUE,
                            "--port", str(port), "--log-level", "WARNING", "--max-open-requests", str(max(n, 1)),
                            "--redis-connections", str(SERVE_CONNECTIONS)], serve_log)
            procs.append(serve)
            serve.wait_healthy(f"{base}/health")
            with Client(srv.url, queue=QUEUE) as c:  # both workers have loaded the model and stepped
                jobs = c.submit_many([{"model": MODEL, "prompt": f"warm {i}", "max_tokens": 2} for i in range(8 * WORKERS)])
                for j in jobs:
                    j.result(timeout=600)
            echo(f"serve-load: {n} concurrent streams of {TOKENS} tokens, {WORKERS} workers, one serve process")
            asyncio.run(_direct(srv.url, min(n, 64), "warm"))
            asyncio.run(_served(base, min(n, 64), "warm"))
            with _Connections(srv.url) as direct_conns:
                direct = asyncio.run(_direct(srv.url, n, "direct"))
            direct["redis_connections_max"] = direct_conns.total
            cpu0 = _cpu_seconds(serve.pid)
            with _Connections(srv.url, (CLIENT_NAME, READER_NAME)) as serve_conns:
                served = asyncio.run(_served(base, n, "serve"))
            cpu = _cpu_seconds(serve.pid) - cpu0
            served["redis_connections_max"] = serve_conns.named
            served["serve_cpu_s"] = cpu
            served["serve_cpu_s_per_1k_tokens"] = cpu / max(1, served["completed"] * TOKENS) * 1000
        finally:
            for p in procs:
                p.stop(15)
    ratios = {k: _ratio(direct.get(k), served.get(k)) for k in ("ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s")}
    success = (served["completed"] + served["refused_with_retry_after"]) / n
    data = {"machine": report.machine(device), "workload": "serve-load", "model": "micro-llama-1layer (random)",
            "streams": n, "tokens_per_stream": TOKENS, "workers": WORKERS, "serve_redis_connections": SERVE_CONNECTIONS,
            "direct": direct, "serve": served, "serve_over_direct": ratios, "success_rate": success,
            "targets": {"success_rate": 1.0, "p99_ratio": TARGET_P99_RATIO},
            "met": {"success_rate": success == 1.0,
                    "p99_ratio": all(r is not None and r <= TARGET_P99_RATIO
                                     for k, r in ratios.items() if k.endswith("p99_s"))}}
    path = report.write_json(data, out, "serve-load.json")
    echo(table(data))
    echo(f"wrote {path}")
    return data


def table(data: dict) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1000:.0f} ms"

    d, s, r = data["direct"], data["serve"], data["serve_over_direct"]
    rows = [("", "direct Redis", "pagedq serve", "serve / direct")]
    for k, label in (("ttft_p50_s", "TTFT p50"), ("ttft_p99_s", "TTFT p99"), ("e2e_p50_s", "e2e p50"),
                     ("e2e_p99_s", "e2e p99")):
        rows.append((label, ms(d[k]), ms(s[k]), "-" if r[k] is None else f"{r[k]:.2f}x"))
    rows.append(("completed", f"{d['completed']}/{d['requests']}", f"{s['completed']}/{s['requests']}", ""))
    rows.append(("429 + Retry-After", "-", str(s["refused_with_retry_after"]), ""))
    rows.append(("Redis connections (max)", f"{d['redis_connections_max']} (all)", str(s["redis_connections_max"]),
                 ""))
    rows.append(("serve CPU / 1k tokens", "-", f"{s['serve_cpu_s_per_1k_tokens']:.2f} s", ""))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join([f"serve-load on {data['machine']['cpu']} ({data['machine']['cpu_cores']} cores): "
                      f"{data['streams']} streams x {data['tokens_per_stream']} tokens", *lines])
