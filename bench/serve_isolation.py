"""The serve-isolation workload (issue 38): what one client's costly requests do to everyone else's streams.

STREAMS streams run through one `pagedq serve` process the whole time (each client starts another request when
one ends), on a worker serving the one-layer random model (bench.overhead.micro_model: tokens come fast, so a
stall of the server shows in the gaps between them). Their inter-token gaps, as the clients see them (one per
write of the server that reaches them), are measured alone, then while each of these goes on:

- schemas-500kb: SCHEMA_SENDERS clients sending ~500 KB JSON schemas back to back (refused: the constraint limit
  is 64 KiB, checked before anything is compiled);
- schemas-compiled: as many sending distinct ~60 KB schemas that the grammar engine compiles in full (each ends
  in a broken pattern, so it is refused after its compile and no job runs: the server's work, not the worker's);
- batch-50k: a BATCH_LINES-line file uploaded (/v1/files) and made a batch (/v1/batches), its lines for a model
  routed to a queue no worker reads (its jobs wait: what is measured is the server creating the batch).

Reported: each phase's gap p50 / p99 and p99(with) / p99(alone) (target: <= 1.5x), with what each disturbance
sent and got. The disturbances run in a process of their own, so that their client's work does not delay the
streams' readers in this one. Everything shares the machine's cores: on a small one the worker and Redis slow
down with the rest.

`python3 -m bench.serve_isolation [--quick]` or `pagedq bench -w serve-isolation`.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

from bench.harness import Process, start_logged
from bench.report import write_json
from bench.serve_load import pct

STREAMS = 50
TOKENS = 256  # per request; a stream's client sends the next when one ends
SCHEMA_SENDERS = 8
SCHEMA_BYTES = 500_000
COMPILED_FIELDS = 280  # ~60 KB: under the constraint limit, tens of ms of the grammar engine's work each
BATCH_LINES = 50_000
WINDOW_S = 6.0  # how long a disturbance that has no end of its own goes on (and the alone phase)
TARGET_P99_RATIO = 1.5
QUICK = {"streams": 8, "window_s": 2.0, "batch_lines": 2000}
QUEUE = "serve-isolation"
MODEL = "micro"
PARKED = "parked"  # the batch's model: routed to a queue no worker reads
N = b"__N__"  # replaced in each schema body by a number, so that no two are the same spec


# ---- what the disturbances send ---------------------------------------------------------------------------------

def _schema(fields: int, tail: dict | None = None) -> dict:
    props = {f"field_{i}": {"type": "object", "required": ["a", "b"], "properties": {
        "a": {"type": "string", "pattern": f"^[a-z]{{{i % 5 + 1},{i % 7 + 6}}}$"},
        "b": {"type": "integer", "minimum": i}, "c": {"enum": [f"v{i}_{j}" for j in range(5)]}}}
        for i in range(fields)}
    return {"type": "object", "properties": {**props, **(tail or {})}, "required": list(props)[: fields // 2]}


def _chat_body(schema: dict) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Fill it in."}], "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n__N__", "schema": schema}}}
    return json.dumps(body, separators=(",", ":")).encode()


def schema_500kb() -> bytes:
    fields = 10
    while len(_chat_body(_schema(fields))) < SCHEMA_BYTES:
        fields = int(fields * 1.5)
    return _chat_body(_schema(fields))


def schema_compiled() -> bytes:
    # The broken pattern comes last: the grammar engine does the rest of the work before it finds it.
    return _chat_body(_schema(COMPILED_FIELDS, {"zz__N__": {"type": "string", "pattern": "(unclosed"}}))


def batch_file(lines: int) -> bytes:
    return b"".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                "body": {"model": PARKED, "prompt": f"Line {i}: once upon a time", "max_tokens": 16}
                                }).encode() + b"\n" for i in range(lines))


# ---- the disturbances, in a process of their own ----------------------------------------------------------------

def send_schemas(base: str, body: bytes, senders: int, window_s: float) -> dict:
    """`senders` clients posting `body` (numbered afresh each time) back to back for `window_s`."""
    import httpx

    async def run() -> dict:
        answers: Counter[str] = Counter()
        end = time.perf_counter() + window_s
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=senders)) as http:
            async def sender(k: int) -> None:
                i = k
                while time.perf_counter() < end:
                    r = await http.post(f"{base}/v1/chat/completions", content=body.replace(N, str(i).encode()),
                                        headers={"Content-Type": "application/json"})
                    code = r.json().get("error", {}).get("code") if r.status_code != 200 else ""
                    answers[f"{r.status_code} {code}".strip()] += 1
                    i += senders

            await asyncio.gather(*(sender(k) for k in range(senders)))
        return {"requests": sum(answers.values()), "request_bytes": len(body), "answers": dict(answers)}

    return asyncio.run(run())


def create_batch(base: str, data: bytes) -> dict:
    """Upload `data` as a batch input file, then make it a batch; how long each took."""
    import httpx

    with httpx.Client(timeout=600) as http:
        start = time.perf_counter()
        f = http.post(f"{base}/v1/files", files={"file": ("isolation.jsonl", data)}, data={"purpose": "batch"})
        f.raise_for_status()
        uploaded = time.perf_counter()
        b = http.post(f"{base}/v1/batches", json={"input_file_id": f.json()["id"], "endpoint": "/v1/completions",
                                                  "completion_window": "24h"})
        b.raise_for_status()
        done = time.perf_counter()
    return {"file_bytes": len(data), "lines": data.count(b"\n"), "upload_s": uploaded - start,
            "create_s": done - uploaded, "batch_status": b.json()["status"]}


# ---- the streams ------------------------------------------------------------------------------------------------

async def _stream(base: str, body: bytes, arrivals: list[tuple[float, float]], seen: asyncio.Event) -> None:
    """One streamed completion over a connection of its own: (time, gap since the previous) for each chunk that
    reaches the client after its first (a chunk is one write of the server's, however many tokens it holds)."""
    host, _, port = base.removeprefix("http://").partition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"a stream was refused: {head[:60]!r}")
        last = None
        while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
            await reader.readexactly(size + 2)
            now = time.perf_counter()
            if last is not None:
                arrivals.append((now, now - last))
            last = now
            seen.set()
    finally:
        writer.close()


async def _client(base: str, i: int, arrivals: list[tuple[float, float]], seen: asyncio.Event) -> None:
    n = 0
    while True:  # until cancelled: the phase's end
        body = json.dumps({"model": MODEL, "prompt": f"stream {i}.{n}: a few words to start from",
                           "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}).encode()
        await _stream(base, body, arrivals, seen)
        n += 1


async def _phase(base: str, streams: int, disturb: Callable[[], Awaitable[dict]]) -> dict:
    """Run `streams` streams; once each has had a token, run `disturb`; the gaps that ended meanwhile."""
    arrivals: list[tuple[float, float]] = []
    seen = [asyncio.Event() for _ in range(streams)]
    clients = [asyncio.create_task(_client(base, i, arrivals, seen[i])) for i in range(streams)]
    try:
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in seen)), 300)
        start = time.perf_counter()
        info = await disturb()
        end = time.perf_counter()
    finally:
        for c in clients:
            c.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
    gaps = [gap for t, gap in arrivals if start <= t <= end]
    return {"window_s": end - start, "gaps": len(gaps), "gap_p50_s": pct(gaps, 50), "gap_p99_s": pct(gaps, 99),
            **info}


# ---- the run ----------------------------------------------------------------------------------------------------

async def _phases(base: str, streams: int, window_s: float, batch_lines: int) -> dict:
    loop = asyncio.get_running_loop()
    big, compiled, batch = schema_500kb(), schema_compiled(), batch_file(batch_lines)
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as other:
        await loop.run_in_executor(other, time.sleep, 0)  # the process is up before anything is measured

        def elsewhere(fn: Callable, *args) -> Callable[[], Awaitable[dict]]:
            return lambda: loop.run_in_executor(other, fn, *args)

        async def alone() -> dict:
            await asyncio.sleep(window_s)
            return {}

        return {"alone": await _phase(base, streams, alone),
                "schemas-500kb": await _phase(base, streams, elsewhere(send_schemas, base, big, SCHEMA_SENDERS,
                                                                       window_s)),
                "schemas-compiled": await _phase(base, streams, elsewhere(send_schemas, base, compiled,
                                                                          SCHEMA_SENDERS, window_s)),
                "batch-50k": await _phase(base, streams, elsewhere(create_batch, base, batch))}


def run_serve_isolation(device: str = "cpu", quick: bool = False, streams: int | None = None,
                        out_dir: str = "bench/results", echo: Callable[[str], None] = print) -> dict:
    """Run the workload; write serve-isolation.json to `out_dir` and return its figures."""
    from bench import report
    from bench.overhead import micro_model
    from producer import Client
    from worker.redis_server import RedisServer, free_port

    n = streams or (QUICK["streams"] if quick else STREAMS)
    window_s = QUICK["window_s"] if quick else WINDOW_S
    lines = QUICK["batch_lines"] if quick else BATCH_LINES
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = micro_model()
    procs: list[Process] = []
    with RedisServer() as srv:
        try:
            procs.append(start_logged([sys.executable, "-m", "cli", "worker", "--redis-url", srv.url, "--queue", QUEUE,
                                 "--model", model, "--device", device, "--max-num-seqs", str(max(64, n)),
                                 "--num-kv-blocks", "8192", "--max-model-len", "512", "--served-model-name", MODEL,
                                 "--log-level", "WARNING"], out / "serve-isolation-worker.log"))
            port = free_port()
            base = f"http://127.0.0.1:{port}"
            serve_log = out / "serve-isolation-serve.log"
            serve = start_logged([sys.executable, "-m", "cli", "serve", "--redis-url", srv.url, "--queue", QUEUE,
                            "--port", str(port), "--log-level", "WARNING", "--model", MODEL,
                            "--route", f"{PARKED}={QUEUE}-parked"], serve_log)
            procs.append(serve)
            serve.wait_healthy(f"{base}/health")
            with Client(srv.url, queue=QUEUE) as c:  # the worker has loaded the model and stepped
                c.submit(model=MODEL, prompt="warm", max_tokens=2).result(timeout=600)
            echo(f"serve-isolation: {n} streams, alone and beside each disturbance ({window_s:g} s, or the batch)")
            phases = asyncio.run(_phases(base, n, window_s, lines))
        finally:
            for p in procs:
                p.stop(15)
    alone = phases["alone"]["gap_p99_s"]
    ratios = {k: (v["gap_p99_s"] / alone if alone and v["gap_p99_s"] else None)
              for k, v in phases.items() if k != "alone"}
    data = {"machine": report.machine(device), "workload": "serve-isolation", "model": "micro-llama-1layer (random)",
            "streams": n, "tokens_per_request": TOKENS, "schema_senders": SCHEMA_SENDERS, "phases": phases,
            "p99_over_alone": ratios, "target_p99_ratio": TARGET_P99_RATIO,
            "met": all(r is not None and r <= TARGET_P99_RATIO for r in ratios.values())}
    path = write_json(data, out, "serve-isolation.json")
    echo(json.dumps({"phases": {k: {m: v.get(m) for m in ("gaps", "gap_p50_s", "gap_p99_s")}
                                for k, v in phases.items()}, "p99_over_alone": ratios, "met": data["met"]}, indent=2))
    echo(f"wrote {path}")
    return data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK}")
    ap.add_argument("--streams", type=int, default=None, help=f"concurrent streams (default {STREAMS})")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out-dir", default="bench/results")
    a = ap.parse_args()
    run_serve_isolation(a.device, a.quick, a.streams, a.out_dir)


if __name__ == "__main__":
    main()
