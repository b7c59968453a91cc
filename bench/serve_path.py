"""pagedq through `pagedq serve`: the Redis path's queue and worker behind the OpenAI-compatible HTTP server,
driven by the official async OpenAI client with streaming, the way an app that switched its base URL uses it.

Times are the client's: TTFT from sending the request to its first text chunk, TPOT from the first to the last
chunk over the tokens the usage chunk reports.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from bench.harness import NotReady, Process, start_logged
from bench.redis_path import QUEUE, RedisPath, Unavailable
from bench.result import Outcome, Run, tpot
from bench.systems import SERVE, bar
from bench.workloads import Workload


class ServePath:
    def __init__(self, redis: RedisPath, model: str, log_path: Path, start_timeout: float = 60.0) -> None:
        self.redis = redis
        self.model = model  # the worker serves the name it was started with
        self.log_path = log_path
        self.start_timeout = start_timeout
        self.proc: Process | None = None
        self.base = ""

    def start(self) -> ServePath:
        try:
            import openai  # noqa: F401
        except ImportError as e:
            raise Unavailable(f"needs the openai package and pagedq[serve]: {e}") from None
        from worker.redis_server import free_port

        port = free_port()
        cmd = [sys.executable, "-m", "cli", "serve", "--redis-url", self.redis.server.url, "--queue", QUEUE,
               "--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING"]
        self.base = f"http://127.0.0.1:{port}"
        try:
            self.proc = start_logged(cmd, self.log_path, health=f"{self.base}/health", timeout=self.start_timeout,
                                     name="pagedq serve")
        except NotReady as e:
            raise Unavailable(str(e)[-1500:]) from None
        return self

    def run(self, wl: Workload, progress: bool = True) -> Run:
        return asyncio.run(self._run(wl, progress))

    async def _run(self, wl: Workload, progress: bool) -> Run:
        from openai import AsyncOpenAI

        n = len(wl.requests)
        arrivals = wl.arrivals or [0.0] * n
        client = AsyncOpenAI(base_url=f"{self.base}/v1", api_key="bench", max_retries=0, timeout=3600)
        with bar(n, f"{wl.name}: {SERVE}", progress) as pb:
            t0 = time.perf_counter()

            async def one(i: int) -> Outcome:
                r = wl.requests[i]
                await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
                sent = time.perf_counter()
                first = last = None
                usage = finish = None
                stream = await client.completions.create(
                    model=self.model, prompt=r.prompt, max_tokens=r.max_tokens, temperature=0, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
                async for chunk in stream:
                    now = time.perf_counter()
                    if chunk.choices and chunk.choices[0].text:
                        first = first or now
                        last = now
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                    if chunk.usage:
                        usage = chunk.usage
                pb.update(1)
                n_out = usage.completion_tokens if usage else 0
                err = None
                if finish != "length":
                    err = f"finish_reason {finish}"
                elif usage is None or usage.prompt_tokens != len(r.prompt_ids):
                    err = f"prompt encoded to {usage and usage.prompt_tokens} tokens, expected {len(r.prompt_ids)}"
                details = usage and usage.prompt_tokens_details
                return Outcome(r.id, len(r.prompt_ids), r.max_tokens, n_out, None if first is None else first - sent,
                               tpot(first, last, n_out), err, (details and details.cached_tokens) or 0)

            outcomes = await asyncio.gather(*(one(i) for i in range(n)))
            elapsed = time.perf_counter() - t0
        await client.close()
        return Run(SERVE, wl.name, list(outcomes), elapsed)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stop(15)
            self.proc = None
