"""`pagedq worker`: one worker process, its engine and its queue."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
from typing import Any

import click

from cli.errors import check_redis
from cli.options import default_of, queue_options
from engine.config import QUANTIZATIONS, SPECULATIVE, EngineConfig
from producer.protocol import Limits
from worker import LOG_FORMAT
from worker.config import WorkerConfig

# Options named otherwise than the Limits field they set.
LIMIT_OPTIONS = {"max_prompt_chars": "max_prompt_chars", "max_tokens_limit": "max_tokens",
                 "max_metadata_bytes": "max_metadata_bytes"}


@click.command()
@queue_options
@click.option("--model", envvar="PAGEDQ_MODEL", default=default_of(EngineConfig, "model"),
              help="Alias, local HF folder, .gguf file or hub id")
@click.option("--device", envvar="PAGEDQ_DEVICE", default=default_of(EngineConfig, "device"), help="cpu or cuda[:N]")
@click.option("--dtype", envvar="PAGEDQ_DTYPE", default=default_of(EngineConfig, "dtype"),
              help="float32 | bfloat16 | float16 | auto (bfloat16 on cuda and on CPUs with bfloat16 units); "
                   "default: float32 on cpu, bfloat16 on cuda")
@click.option("--quantization", envvar="PAGEDQ_QUANTIZATION", type=click.Choice(QUANTIZATIONS),
              default=default_of(EngineConfig, "quantization"), show_default=True,
              help="CPU: auto keeps a GGUF's Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K weights, or an AWQ/GPTQ checkpoint's, quantized "
                   "in memory; none dequantizes them to float; int8 (per channel) and int4 (groups of 32) make "
                   "weight-only integers of any float model's weights")
@click.option("--max-num-seqs", envvar="PAGEDQ_MAX_NUM_SEQS", type=int, default=default_of(EngineConfig, "max_num_seqs"),
              help="Sequences in one batch; default by device: 256")
@click.option("--max-num-batched-tokens", envvar="PAGEDQ_MAX_NUM_BATCHED_TOKENS", type=int,
              default=default_of(EngineConfig, "max_num_batched_tokens"),
              help="Tokens (prefill chunks and decodes) in one engine step; default by device: 4096 on cpu, 8192 on cuda")
@click.option("--max-model-len", envvar="PAGEDQ_MAX_MODEL_LEN", type=int,
              default=default_of(EngineConfig, "max_model_len"),
              help="Longest prompt + output in tokens; default: the model's, capped by the KV cache")
@click.option("--num-kv-blocks", envvar="PAGEDQ_NUM_KV_BLOCKS", type=int,
              default=default_of(EngineConfig, "num_kv_blocks"), help="KV cache size in blocks; default: sized from memory")
@click.option("--block-size", envvar="PAGEDQ_BLOCK_SIZE", type=int, default=default_of(EngineConfig, "block_size"),
              help="Tokens per KV cache block")
@click.option("--overlap-steps/--no-overlap-steps", envvar="PAGEDQ_OVERLAP_STEPS",
              default=default_of(EngineConfig, "overlap_steps"),
              help="Schedule each step while the one before runs on the device; default: on for cuda, off for cpu")
@click.option("--speculative", envvar="PAGEDQ_SPECULATIVE", type=click.Choice(SPECULATIVE),
              default=default_of(EngineConfig, "speculative"), show_default=True,
              help="ngram: greedy jobs propose tokens by prompt lookup and verify them in one step (the same output, "
                   "several tokens a step where the output copies the prompt); suffix: that, else what recent outputs did "
                   "after the same text; draft: a draft model proposes them (--draft-model); not with --overlap-steps")
@click.option("--draft-model", envvar="PAGEDQ_DRAFT_MODEL", default=default_of(EngineConfig, "draft_model"),
              help="With --speculative draft: the draft model (alias, local HF folder, .gguf file or hub id); it must "
                   "share --model's tokenizer")
@click.option("--draft-quantization", envvar="PAGEDQ_DRAFT_QUANTIZATION", type=click.Choice(QUANTIZATIONS),
              default=default_of(EngineConfig, "draft_quantization"), show_default=True,
              help="With --speculative draft: the draft's weights, as --quantization says")
@click.option("--num-speculative-tokens", envvar="PAGEDQ_NUM_SPECULATIVE_TOKENS", type=click.IntRange(min=1),
              default=default_of(EngineConfig, "num_speculative_tokens"), show_default=True,
              help="With --speculative: draft tokens per sequence per step, at most")
@click.option("--tensor-parallel-size", envvar="PAGEDQ_TENSOR_PARALLEL_SIZE", type=click.IntRange(min=1),
              default=default_of(EngineConfig, "tensor_parallel_size"), show_default=True,
              help="Ranks one model replica is split over (tensor parallelism); this worker is rank 0 and starts "
                   "the others of its host")
@click.option("--cpu-threads-per-rank", envvar="PAGEDQ_CPU_THREADS_PER_RANK", type=click.IntRange(min=1),
              default=default_of(EngineConfig, "cpu_threads_per_rank"),
              help="CPU: threads of each rank; default: the host's cores shared evenly by its ranks")
@click.option("--dist-init-addr", envvar="PAGEDQ_DIST_INIT_ADDR", default=default_of(EngineConfig, "dist_init_addr"),
              help="Ranks on several hosts: host:port where node 0 (rank 0) meets the others")
@click.option("--nnodes", envvar="PAGEDQ_NNODES", type=click.IntRange(min=1), default=default_of(EngineConfig, "nnodes"),
              show_default=True, help="Hosts the ranks span (each runs tensor-parallel-size / nnodes ranks)")
@click.option("--node-rank", envvar="PAGEDQ_NODE_RANK", type=click.IntRange(min=0),
              default=default_of(EngineConfig, "node_rank"), show_default=True,
              help="This host's index; above 0 it runs only its ranks, for the worker on node 0")
@click.option("--served-model-name", envvar="PAGEDQ_SERVED_MODEL_NAME", multiple=True,
              help="Names a job's `model` may use (repeatable); default: --model")
@click.option("--result-ttl", envvar="PAGEDQ_RESULT_TTL", type=int, default=default_of(WorkerConfig, "result_ttl"),
              help="Seconds a result and its event stream are kept")
@click.option("--max-prompt-chars", envvar="PAGEDQ_MAX_PROMPT_CHARS", type=int,
              default=default_of(Limits, "max_prompt_chars"),
              help="Longest prompt (all messages) in characters; longer jobs fail at once")
@click.option("--max-tokens-limit", envvar="PAGEDQ_MAX_TOKENS_LIMIT", type=int, default=default_of(Limits, "max_tokens"),
              help="Largest max_tokens a job may ask for")
@click.option("--max-metadata-bytes", envvar="PAGEDQ_MAX_METADATA_BYTES", type=int,
              default=default_of(Limits, "max_metadata_bytes"), help="Largest `metadata` of a job, as JSON")
@click.option("--drain-timeout", envvar="PAGEDQ_DRAIN_TIMEOUT", type=float,
              default=default_of(WorkerConfig, "drain_timeout"),
              help="On SIGTERM: seconds running jobs may still finish; the rest are handed back")
@click.option("--lease-ms", envvar="PAGEDQ_LEASE_MS", type=int, default=default_of(WorkerConfig, "lease_ms"),
              help="A job whose lease is not renewed this long is reclaimed by another worker")
@click.option("--max-attempts", envvar="PAGEDQ_MAX_ATTEMPTS", type=int, default=default_of(WorkerConfig, "max_attempts"),
              help="Deliveries before a job goes to the dead-letter stream")
@click.option("--dlq-cap", envvar="PAGEDQ_DLQ_CAP", type=int, default=default_of(WorkerConfig, "dlq_cap"),
              help="Dead letters kept")
@click.option("--metrics-port", envvar="PAGEDQ_METRICS_PORT", type=int, default=default_of(WorkerConfig, "metrics_port"),
              help="Serve Prometheus metrics on this port")
@click.option("--heartbeat-s", envvar="PAGEDQ_HEARTBEAT_S", type=float, default=default_of(WorkerConfig, "heartbeat_s"),
              help="Seconds between heartbeats; the worker's record in Redis lives three times as long")
@click.option("--durability", envvar="PAGEDQ_DURABILITY", type=click.Choice(["async", "replicated"]),
              default=default_of(WorkerConfig, "durability"), show_default=True,
              help="replicated: every write waits for replicas (WAIT); a job's end counts once a replica has it")
@click.option("--durability-replicas", envvar="PAGEDQ_DURABILITY_REPLICAS", type=click.IntRange(min=1),
              default=default_of(WorkerConfig, "durability_replicas"), show_default=True,
              help="With --durability replicated: replicas that must confirm each write")
@click.option("--durability-timeout-ms", envvar="PAGEDQ_DURABILITY_TIMEOUT_MS", type=click.IntRange(min=1),
              default=default_of(WorkerConfig, "durability_timeout_ms"), show_default=True,
              help="With --durability replicated: how long one WAIT waits for them")
@click.option("--lane-floor", envvar="PAGEDQ_LANE_FLOOR", type=click.IntRange(min=1),
              default=default_of(WorkerConfig, "lane_floor"), show_default=True,
              help="Of every N+1 jobs taken while a lower lane has jobs waiting, one is that lane's: urgent lanes "
                   "first, yet batches are never starved")
@click.option("--preempt-for-priority/--no-preempt-for-priority", envvar="PAGEDQ_PREEMPT_FOR_PRIORITY",
              default=default_of(EngineConfig, "preempt_for_priority"), show_default=True,
              help="With the batch full, preempt the running jobs of a lower lane or priority for a more urgent job")
@click.option("--strict/--no-strict", envvar="PAGEDQ_STRICT", default=default_of(WorkerConfig, "strict"),
              help="Refuse to start on a Redis that may evict keys (maxmemory-policy other than noeviction)")
@click.option("--worker-id", envvar="PAGEDQ_WORKER_ID", default=None, help="Default: hostname-pid-random")
@click.option("--log-level", envvar="PAGEDQ_LOG_LEVEL", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
def worker(log_level: str, **options: Any) -> None:
    """Run one worker: pull jobs from QUEUE into the engine, stream tokens and results back."""
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    if options["node_rank"] > 0:  # ranks for a replica whose worker (rank 0) runs on node 0: no queue here
        _serve_node(engine_config(options))
    check_redis(options["redis_url"])  # before the model: loading it takes a while, and Redis is the likelier problem
    import redis as redis_lib

    from producer.durability import Durability
    from worker import preflight

    try:  # a Redis that may lose jobs, or cannot give the durability asked for: said before the model loads
        preflight.check(options["redis_url"], Durability(options["durability"], options["durability_replicas"],
                                                         options["durability_timeout_ms"]), options["strict"])
    except preflight.Refused as e:
        raise click.ClickException(str(e)) from None

    from engine import LLMEngine
    from producer.connection import redact
    from worker.worker import Worker

    engine = LLMEngine(engine_config(options))
    cfg = worker_config(options, engine.model_name)
    try:
        w = Worker(engine, cfg)
        _stop_on_signals(w, cfg.drain_timeout)
        w.run()
    except (redis_lib.AuthenticationError, redis_lib.exceptions.NoPermissionError) as e:
        # A credentials problem is the operator's to fix: say so plainly, without a traceback or the password.
        raise click.ClickException(f"redis at {redact(cfg.redis_url)} refused this worker: {e}") from None


def _serve_node(config: EngineConfig) -> None:
    from engine.parallel.ranks import serve_node
    from engine.runner.model_runner import ModelRunner
    from engine.weights.loader import resolve_model

    try:
        folder = resolve_model(config.model, config.cache_dir)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    raise SystemExit(serve_node(config, str(folder), ModelRunner))


def engine_config(options: dict[str, Any]) -> EngineConfig:
    """The EngineConfig of the command's options named as its fields, which it takes out of `options`."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{name: options.pop(name) for name in list(options) if name in fields})


def worker_config(options: dict[str, Any], model: str) -> WorkerConfig:
    """The WorkerConfig of the command's other options; `model`: the engine's."""
    limits = Limits(**{field: options.pop(option) for option, field in LIMIT_OPTIONS.items()})
    served = tuple(options.pop("served_model_name")) or (model,)
    worker_id = options.pop("worker_id")
    cfg = WorkerConfig(**options, served_models=served, limits=limits)
    if worker_id:  # else WorkerConfig's own: hostname-pid-random
        cfg.worker_id = worker_id
    return cfg


def _stop_on_signals(w, drain_timeout: float) -> None:
    def on_signal(signum, frame):
        log = logging.getLogger("pagedq.worker")
        if w.stop_event.is_set():
            # A second signal: exit now. What runs is not lost: its leases lapse and other workers resume it.
            log.warning("signal %d again: exiting at once", signum)
            os._exit(1)
        log.info("signal %d: finishing running jobs (up to %.0f s), then stopping", signum, drain_timeout)
        w.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
