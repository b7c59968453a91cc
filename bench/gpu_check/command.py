"""`pagedq gpu-check`: the one command to run on a GPU. Prints a table, writes one JSON.

Sections, cheapest first, each with a time budget (a section stops its sweep once its budget is spent and says how
far it got):
1. kernels: store_kv and paged_attention in bf16, fp16 and fp32, checked against host-side oracles that share
   nothing with them: where every new token's K/V must land is worked out from the block table (and nothing else
   may change in the cache, padding rows' slot -1 included), attention is dense float64 attention over those
   expected caches. Decode, prefill, chunked and mixed batches, forced and automatic split-K, padding rows
   (seq_len 0) with split-K, a 40,000-block cache. Then what each compiled variant uses (registers, spills,
   shared memory), as the GPU's driver loaded it. And the quantized matmul (pagedq_kernels/triton_quant.py, bench.gpu_check.quant):
   every weight layout and dtype against a float64 matmul, its weights against Blocks.dequantize() bit for bit, and
   decode-shaped timings against F.linear on bfloat16 weights (reported, never a target).
2. bandwidth: decode attention, batch {1, 8, 64, 256} x context {512, 2048, 8192}, timed inside CUDA graphs over
   block tables that rotate through more memory than the L2 holds; K/V bytes read per second as a fraction of a
   device-to-device copy's bytes moved per second (read + write), also timed in a CUDA graph, in the same run.
3. graphs: the same requests through an engine that replays CUDA graphs and one with enforce_eager=True, greedy,
   token for token (bf16 and fp32; a divergence passes only at a near tie of the two tokens); decode steps/s of
   both at batch 1/8/64 with torch.cuda.set_sync_debug_mode("error") around the steady loop (a host sync there
   fails the section, with the op's message and where it was called).
4. e2e: the bench's chat and mixed workloads, the engine against transformers static batching and generate_batch.
5. tensor_parallel, with --tensor-parallel-size N (N > 1, N GPUs from --device's on): one replica over N GPUs (NCCL,
   CUDA graphs with the all-reduces inside) against one GPU, the same requests greedy, token for token (a divergence
   passes only at a near tie); decode steps/s of both at batch 1/8/64. Skipped at N = 1.

--model picks the model of sections 3 and 4: an alias or a Hugging Face folder; a folder with config.json and the
tokenizer but no weights (random weights of that shape are made once, in the pagedq cache: how an offline GPU
machine runs SmolLM2's shapes); or `tiny`. `--prepare DIR` writes such a folder (and a tiny model) where the model
package is installed, for a machine where it is not.

No network and no Redis: `python -m bench.gpu_check` runs it where neither click nor redis is installed.
Exit status: 0 every section correct and every target met; 1 a section failed (a wrong result, an error, a host
sync in the steady loop); 2 a usage error; 3 no CUDA GPU here; 4 all correct, but a target was missed or a budget
ran out before a sweep ended. `--device cpu` (with TRITON_INTERPRET=1) runs the code at toy sizes: a smoke test.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import time
from pathlib import Path

from bench.gpu_check.bandwidth import attention_bandwidth
from bench.gpu_check.common import (
    BUDGETS,
    FAILED,
    NO_GPU,
    OK,
    SECTIONS,
    SHORT,
    USAGE,
    Budget,
    _tail,
    _write,
)
from bench.gpu_check.e2e import end_to_end
from bench.gpu_check.graphs import graph_check
from bench.gpu_check.kernels import check_kernels
from bench.gpu_check.models import prepare
from bench.gpu_check.report import table, targets
from bench.gpu_check.tensor_parallel import tensor_parallel_check
from engine.config import DEFAULT_MODEL
from engine.weights.loader import cache_root

# The command's options, once: `pagedq gpu-check` (bench.cli, click) and `python -m bench.gpu_check` (argparse,
# where click is not installed) are made from them. (flag, default, help)
OPTIONS = (
    ("--out", None, "Where the JSON goes (default: gpu-check.json in the pagedq cache folder, $PAGEDQ_CACHE or "
                    "~/.cache/pagedq)"),
    ("--device", "cuda", "The GPU to check (cuda[:N]); cpu runs the code at toy sizes under TRITON_INTERPRET=1"),
    ("--sections", ",".join(SECTIONS), "Comma-separated subset; they run cheapest first"),
    ("--model", DEFAULT_MODEL, "Model of the graphs and e2e sections: an alias, a Hugging Face folder, a folder "
                               "with config.json and tokenizer but no weights (random weights of its shape), or tiny"),
    ("--budgets", ",".join(f"{k}={v}" for k, v in BUDGETS.items()),
     "Seconds per section (NAME=S,...): a section stops its sweep when its budget is spent"),
    ("--tensor-parallel-size", "1", "GPUs of one replica in the tensor_parallel section, from --device's on; 1 skips "
                                    "it"),
    ("--prepare", None, "Write what an offline GPU machine needs into this folder (the default model's config and "
                        "tokenizer, a tiny random model), then exit"),
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pagedq gpu-check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default, help in OPTIONS:
        ap.add_argument(flag, default=default, help=help if default is None else f"{help} (default {default})")
    return run_options(vars(ap.parse_args(argv)))


def run_options(opts: dict, echo=print) -> int:
    """OPTIONS' values as strings (both command lines) -> the exit status."""
    if opts.get("prepare"):
        return prepare(opts["prepare"], echo)
    sections = [s.strip() for s in opts["sections"].split(",") if s.strip()]
    try:
        budgets = parse_budgets(opts["budgets"])
    except ValueError as e:
        echo(f"gpu-check: {e}")
        return USAGE
    size = str(opts.get("tensor_parallel_size") or 1)
    if not size.isdigit() or int(size) < 1:
        echo(f"gpu-check: --tensor-parallel-size must be a whole number >= 1, not {size!r}")
        return USAGE
    return run(opts["out"], opts["device"], sections, opts["model"], budgets, echo, int(size))


def parse_budgets(text: str) -> dict[str, float]:
    budgets = dict(BUDGETS)
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, _, seconds = item.partition("=")
        if name not in SECTIONS:
            raise ValueError(f"--budgets: unknown section {name!r}; choose from {', '.join(SECTIONS)}")
        try:
            budgets[name] = float(seconds)
        except ValueError:
            raise ValueError(f"--budgets: {item!r} is not NAME=SECONDS") from None
    return budgets


def default_out() -> Path:
    return cache_root() / "gpu-check.json"


def run(out: str | None = None, device: str = "cuda", sections: list[str] | tuple[str, ...] = SECTIONS,
        model: str = DEFAULT_MODEL, budgets: dict[str, float] | None = None, echo=print,
        tensor_parallel_size: int = 1) -> int:
    import torch

    unknown = set(sections) - set(SECTIONS)
    if unknown or not sections:
        echo(f"gpu-check: unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
        return USAGE
    smoke = device == "cpu"
    if smoke and os.environ.get("TRITON_INTERPRET") != "1":
        echo("gpu-check: --device cpu runs the code at toy sizes under the Triton interpreter: set TRITON_INTERPRET=1")
        return USAGE
    if not smoke and not device.startswith("cuda"):
        echo(f"gpu-check: --device must be cuda[:N] (or cpu for a smoke run), not {device!r}")
        return USAGE
    if not smoke and not torch.cuda.is_available():
        echo("gpu-check: no CUDA GPU here (torch.cuda.is_available() is False); nothing was measured")
        return NO_GPU
    if not smoke and "tensor_parallel" in sections and tensor_parallel_size > 1:
        first = torch.device(device).index or 0
        if first + tensor_parallel_size > torch.cuda.device_count():
            echo(f"gpu-check: --tensor-parallel-size {tensor_parallel_size} from {device} needs GPUs {first} to "
                 f"{first + tensor_parallel_size - 1}; this machine has {torch.cuda.device_count()}")
            return USAGE
    import triton

    budgets = {**BUDGETS, **(budgets or {})}
    path = Path(out) if out else default_out()
    data: dict = {"device": "cpu (smoke run: toy sizes, no figures)" if smoke else torch.cuda.get_device_name(device),
                  "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                  "started": time.strftime("%Y-%m-%d %H:%M:%S"), "model": model, "budgets_s": budgets}
    if not smoke:
        props = torch.cuda.get_device_properties(device)
        data["gpu"] = {"capability": f"{props.major}.{props.minor}", "sms": props.multi_processor_count,
                       "memory_gib": round(props.total_memory / 2**30, 1)}
    steps = {"kernels": check_kernels, "bandwidth": attention_bandwidth, "graphs": graph_check, "e2e": end_to_end,
             "tensor_parallel": functools.partial(tensor_parallel_check, size=tensor_parallel_size)}
    for name in SECTIONS:
        if name not in sections:
            continue
        data[name] = _section(name, steps[name], device, budgets[name], model, smoke, echo)
        _write(path, data)
        gc.collect()
        if not smoke:
            torch.cuda.empty_cache()
    data["targets"] = targets(data)
    data["exit_status"] = status = exit_status(data)
    _write(path, data)
    echo(table(data))
    echo(f"wrote {path}")
    return status


def _section(name: str, step, device: str, seconds: float, model: str, smoke: bool, echo) -> dict:
    """One section's result, timed against its budget; a section that raises is a failed one."""
    echo(f"gpu-check: {name} (budget {seconds:g} s) ...")
    budget = Budget(seconds)
    try:
        result = step(device, budget, model, smoke)
    except Exception as e:  # noqa: BLE001 (one section failing must not hide the others' figures)
        result = {"status": "failed", "error": f"{type(e).__name__}: {e}", "traceback": _tail(e)}
    result.setdefault("status", "partial" if result.get("stopped") else "ok")
    result["seconds"] = round(budget.elapsed(), 1)
    result["budget_s"] = seconds
    echo(f"gpu-check: {name}: {result['status']} in {result['seconds']:g} s"
         + (f" ({result['stopped']})" if result.get("stopped") else "")
         + (f": {result['error']}" if result.get("error") else ""))
    return result


def exit_status(data: dict) -> int:
    ran = [data[s] for s in SECTIONS if s in data]
    if any(r["status"] == "failed" for r in ran):
        return FAILED
    if any(r["status"] == "partial" for r in ran) or any(t["met"] is False for t in data.get("targets", [])):
        return SHORT
    return OK
