"""llama.cpp as a peer: its own server (llama-server, continuous batching over --parallel slots) on the same GGUF
file, fed the same token-id prompts over HTTP, greedy, ignore_eos, the same number of new tokens and threads.

llama.cpp is never a dependency of pagedq: build it in a folder of its own from the sources the llama-cpp-python
sdist vendors (docs/benchmarks.md, "llama.cpp as a peer") and name its llama-server with `--llamacpp-server` (or
PAGEDQ_LLAMACPP_SERVER). Every request of a workload is sent at once; the server's slots take them in turn.
"""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.harness import NotReady, Process
from bench.peers import Unavailable, locate
from bench.result import Outcome, Run
from bench.workloads import Workload
from worker.redis_server import free_port

SERVER_ENV = "PAGEDQ_LLAMACPP_SERVER"
LLAMACPP = "llamacpp"
START_TIMEOUT_S = 300


def find_server(server: str | None) -> str:
    return locate(server, SERVER_ENV, "--llamacpp-server", f"no llama.cpp to run: build llama-server "
                  f"(docs/benchmarks.md) and pass --llamacpp-server PATH or set {SERVER_ENV}")


def _post(url: str, body: dict, timeout: float = 3600) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class Server:
    """A running llama-server: `parallel` slots of `ctx_per_slot` tokens each, `threads` threads."""

    def __init__(self, binary: str, gguf: str, threads: int, parallel: int, ctx_per_slot: int, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        start = time.perf_counter()
        cmd = [binary, "-m", gguf, "--port", str(self.port), "--host", "127.0.0.1", "-t", str(threads), "-tb",
               str(threads), "--parallel", str(parallel), "-c", str(parallel * ctx_per_slot), "--cont-batching",
               "-b", "2048", "-ub", "512", "--no-webui"]
        self.proc = Process(cmd, log_path, name="llama-server")
        try:
            self.proc.wait_healthy(self.url + "/health", START_TIMEOUT_S)
        except NotReady as e:
            self.close()
            raise Unavailable(f"{str(e).splitlines()[0]}; see {log_path}") from None
        self.startup_s = time.perf_counter() - start

    def complete(self, prompt_ids: list[int], max_tokens: int) -> dict:
        return _post(self.url + "/completion", {"prompt": prompt_ids, "n_predict": max_tokens, "temperature": 0,
                                                "top_k": 1, "ignore_eos": True, "cache_prompt": False,
                                                "return_tokens": True})

    def close(self) -> None:
        self.proc.stop(30)


def run_workload(server: Server, wl: Workload, parallel: int) -> Run:
    """Every request at once (up to the slots; more wait in the server's queue) -> a Run."""
    t0 = time.perf_counter()

    def one(i: int) -> Outcome:
        r = wl.requests[i]
        sent = time.perf_counter()
        try:
            res = server.complete(list(r.prompt_ids), r.max_tokens)
        except OSError as e:
            return Outcome(r.id, len(r.prompt_ids), r.max_tokens, 0, error=str(e))
        timings = res.get("timings", {})
        produced = int(timings.get("predicted_n", len(res.get("tokens", []))))
        decoding_s = float(timings.get("predicted_ms", 0.0)) / 1e3
        # ttft: sent to the end of its prompt (queue, prefill); tpot: the server's own time per generated token
        return Outcome(r.id, len(r.prompt_ids), r.max_tokens, produced, ttft=time.perf_counter() - sent - decoding_s,
                       tpot=decoding_s / max(1, produced - 1) if produced > 1 else None)

    with ThreadPoolExecutor(max(1, min(len(wl.requests), 4 * parallel))) as pool:
        outcomes = list(pool.map(one, range(len(wl.requests))))
    return Run(LLAMACPP, wl.name, outcomes, time.perf_counter() - t0, note="llama.cpp llama-server")
