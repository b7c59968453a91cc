"""Loads the model, owns the KV cache, and turns a scheduled batch into one forward and sampled tokens."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn
from transformers import AutoConfig

from engine.block_tables import BlockTables
from engine.config import EngineConfig
from engine.models.llama import SUPPORTED_ARCHS, AttnContext, LlamaForCausalLM
from engine.parallel.ranks import Ranks, local_ranks, pin
from engine.parallel.shard import Shard, fail, split_heads
from engine.runner import host_memory, step_inputs
from engine.runner.decode_buffers import DecodeBuffers
from engine.runner.sampler import SamplingBatch, sample
from engine.runner.staging import Staging
from engine.runner.step_inputs import Feed, StepInputs
from engine.runner.step_message import recv_step, send_step, send_stop
from engine.scheduler import SchedulerOutput
from engine.stats import StepTimes
from engine.weights.checkpoint import scheme
from engine.weights.loader import cache_root, gguf_source
from engine.weights.packed import PanelLinear, pack_linears
from engine.weights.quantized import LayerReport, check_mode, quantize, summary
from pagedq_kernels import build, get_backend

log = logging.getLogger("pagedq.engine")

# CPU tensor parallelism on one host: all-reduces through shared memory (engine.parallel.shm_all_reduce), not gloo's
# sockets, for tensors up to this size (larger ones are prefill chunks, where gloo's bandwidth serves).
SHM_MAX_BYTES = 16 << 20
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@contextlib.contextmanager
def _no_random_init() -> Iterator[None]:
    """Linear and embedding weights left as allocated: load_weights fills every parameter (and fails on any the
    checkpoint lacks), so their random init would be thrown away, about a second of a 135M model's start on 2 cores."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


class ModelRunner:
    def __init__(self, config: EngineConfig, folder, shard: Shard | None = None) -> None:
        """shard: this rank's place in a tensor-parallel replica (the ranks engine.parallel.ranks starts); None: rank 0,
        which starts the replica's other ranks on this host when config.tensor_parallel_size > 1."""
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        hf_config = AutoConfig.from_pretrained(folder)
        archs = getattr(hf_config, "architectures", None) or []
        if not archs or archs[0] not in SUPPORTED_ARCHS:
            raise ValueError(
                f"model architecture {archs[0] if archs else hf_config.model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHS)}"
            )
        check_mode(config.quantization, hf_config)
        self.hf_config = hf_config
        model_max = int(getattr(hf_config, "max_position_embeddings", 4096))
        window = getattr(hf_config, "sliding_window", None)
        if window and getattr(hf_config, "use_sliding_window", True):
            model_max = min(model_max, int(window))  # we attend fully, so stay inside the window
        if config.max_model_len is not None and config.max_model_len > model_max:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's limit of {model_max} tokens")
        self.max_model_len = config.max_model_len or model_max
        self.ranks = None  # rank 0's handle on the other ranks of its host (engine.parallel.ranks.Ranks)
        self._threads = torch.get_num_threads()
        self._cores: set[int] | None = None  # the CPU affinity before rank 0 was pinned
        self.shard = shard or self._start_replica(folder)
        try:
            self._build(folder)
        except BaseException:
            if self.ranks is not None:  # the other ranks wait for this one: end them with it
                self.ranks.stop(timeout=0)
                self._unpin()
            raise
        if self.ranks is not None:
            self.ranks.watch()

    def _build(self, folder) -> None:
        """This rank's shard of the model, loaded, and its KV cache (sized alike on every rank)."""
        config, hf_config = self.config, self.hf_config
        self.backend = get_backend(config.attention_backend, config.device,
                                   build.default_root(cache_root(config.cache_dir)))
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device), _no_random_init():
                self.model = LlamaForCausalLM(hf_config, self.max_model_len, self.shard)
        finally:
            torch.set_default_dtype(torch.float32)
        self.model.load_weights(folder)
        self.model.cos = self.model.cos.float()
        self.model.sin = self.model.sin.float()
        self.model.eval()
        if self.backend.layers is not None:
            self.model.use_fast_layers(self.backend.layers)
        self.quantized = self._keep_quantized(folder)
        if self.device.type == "cpu" and config.prepack_weights:
            log.info("prepacked %d linear layers", pack_linears(self.model, config.max_num_seqs, self.backend))
        log.info("kernels: %s", self.backend.describe())
        # The step's logits, written into one buffer (rows of the first max_num_seqs) where the logits layer takes
        # one: allocated afresh, a [rows, vocab] tensor of tens or hundreds of MB is mapped and unmapped every step.
        self.logits_buffer = None
        if isinstance(self.model.lm_head, PanelLinear) and not self.shard.parallel:
            self.logits_buffer = torch.empty(config.max_num_seqs, hf_config.vocab_size, dtype=self.dtype)
        if self.device.type == "cpu" and config.nnodes == 1 and config.shm_all_reduce:
            # Every all-reduce of a decode step, and of prefill chunks up to the cap, through shared memory.
            self.shard.shm_bytes = min(config.max_num_batched_tokens * hf_config.hidden_size * self.dtype.itemsize,
                                       SHM_MAX_BYTES)
        self.shard.join()  # every rank has loaded its shard (rank 0 waits for them in Ranks.wait_ready)
        # The same block count on every rank: block tables index all their caches.
        self.num_blocks = self.shard.all_reduce_min(self._size_cache())
        self.max_model_len = min(self.max_model_len, self.num_blocks * config.block_size)
        self._allocate_cache()
        if self.device.type == "cpu" and self.model.use_decoder(self.backend):
            log.info("the decoder stack runs as one C++ call a step")
        # Decode-only steps through padded static buffers, replayed as CUDA graphs (only with ops that never sync
        # with the host: the Triton ones).
        self.times = StepTimes()  # the engine shares its own
        self.tables = BlockTables()  # the block manager's, once it exists
        self._last_seqs: list | None = None  # the previous step's sequences and inputs (see _steady_after)
        self._last_inputs: StepInputs | None = None
        self.decode_buffers: DecodeBuffers | None = None
        self.staging = Staging(self.device)  # a step's host-to-device copies, none of which waits
        self.graphs = None
        if self.device.type == "cuda" and not config.enforce_eager and self.backend.graph_safe:
            self.use_padded_decode(capture=True)

    def _keep_quantized(self, folder) -> list[LayerReport]:
        """Swap the linear layers whose weights stay quantized (engine.weights.quantized) -> a LayerReport per
        linear layer, or [] where none is."""
        config = self.config
        kept = scheme(self.hf_config)  # an AWQ/GPTQ checkpoint: load_weights dequantized its linears to float
        if self.shard.parallel:
            # A GGUF's blocks are laid out for whole rows; the ranks load slices of its float conversion instead.
            if config.quantization == "auto" and (kept or gguf_source(config.model)):
                log.info("tensor parallelism: the %s weights are dequantized (quantized shards are not there yet)",
                         kept.name if kept else "GGUF")
            return []
        # a CPU's kernels, or the triton backend's on a GPU
        reports = quantize(self.model, config.quantization, gguf_source(config.model), self.backend, folder)
        if reports:
            log.info("weights kept quantized: %s", summary(reports))
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # the float weights they replaced: free for the KV cache's sizing
        return reports

    def _start_replica(self, folder) -> Shard:
        """Rank 0's shard, and with tensor parallelism the other ranks of this host, loading theirs meanwhile. A
        size that does not split the model fails here, before any rank starts."""
        config, hf = self.config, self.hf_config
        size = config.tensor_parallel_size
        if size == 1:
            return Shard()
        heads = hf.num_attention_heads
        split_heads(heads, getattr(hf, "num_key_value_heads", None) or heads, size, 0)
        Shard(0, size).span(hf.intermediate_size, "intermediate (MLP) features")
        self.ranks = Ranks(config, folder, local_ranks(config)[1:], ModelRunner)
        if self.device.type == "cpu":
            # After the ranks started (they would inherit it); close() gives the cores back, for the process may
            # outlive the replica.
            self._cores = os.sched_getaffinity(0)
            pin(config, local_ranks(config).start)
        atexit.register(self.close)  # before multiprocessing's own handler ends them, which the watchdog would see
        return Shard(0, size, self.ranks.init_method, config.device, before_join=self.ranks.wait_ready,
                     on_peer_lost=self.ranks.peer_lost)

    def close(self) -> None:
        """Stop the replica's other ranks (rank 0), and leave its process group."""
        if self.ranks is None:
            return
        send_stop(self.shard)
        self.ranks.stop()
        self.ranks = None
        self.shard.leave()
        self._unpin()

    def _unpin(self) -> None:
        """Rank 0's threads and cores as they were before the replica started."""
        torch.set_num_threads(self._threads)
        if self._cores is not None:
            os.sched_setaffinity(0, self._cores)
            self._cores = None

    def use_padded_decode(self, capture: bool) -> None:
        """Run decode-only steps through padded static buffers; capture: also as CUDA graphs (CUDA only).
        Without capture the padded forward runs eagerly, which is how the CPU tests check the padding."""
        max_blocks = -(-self.max_model_len // self.config.block_size)
        self.decode_buffers = DecodeBuffers(self.config.max_num_seqs, max_blocks, self.device)
        self.graphs = None
        if capture:
            from engine.runner.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self.model, self.decode_buffers, self.backend)
            self.graphs.capture()

    def _size_cache(self) -> int:
        cfg, hf = self.config, self.hf_config
        attn = self.model.model.layers[0].self_attn
        per_block = (2 * hf.num_hidden_layers * cfg.block_size * attn.num_kv_heads * attn.head_dim
                     * torch.tensor([], dtype=self.dtype).element_size())
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # Leave room for activations of the largest batch and the logits of up to max_num_seqs rows.
            reserve = (cfg.max_num_batched_tokens * hf.hidden_size * 24 + cfg.max_num_seqs * hf.vocab_size * 8)
            budget = int(total * cfg.gpu_memory_utilization) - (total - free) - reserve
        else:
            budget = cfg.kv_cache_memory or min(2 << 30, _available_memory() // 4)
        blocks = budget // per_block
        # More than every slot filled to max_model_len is never used.
        cap = cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size)
        blocks = min(blocks, cap)
        if blocks < 1:
            raise ValueError("not enough memory for a KV cache: lower max_num_seqs or set num_kv_blocks")
        return int(blocks)

    def _allocate_cache(self) -> None:
        attn = self.model.model.layers[0].self_attn
        layers = self.model.model.layers
        shape = (2, len(layers), self.num_blocks, self.config.block_size, attn.num_kv_heads, attn.head_dim)
        if self.device.type == "cpu":
            self.kv_cache = host_memory.zeros(shape, self.dtype)
        else:
            self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(layers):
            layer.self_attn.k_cache = self.kv_cache[0, i]
            layer.self_attn.v_cache = self.kv_cache[1, i]
        log.info("KV cache: %d blocks of %d tokens (%.1f MiB)", self.num_blocks, self.config.block_size,
                 self.kv_cache.numel() * self.kv_cache.element_size() / 2**20)

    def _tensors(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor, AttnContext]:
        stage = self.staging.to_device
        ctx = AttnContext(slot_mapping=stage("slots", inputs.slots),
                          query_start_loc=stage("query_start_loc", inputs.query_start_loc),
                          seq_lens=stage("seq_lens", inputs.seq_lens),
                          block_table=stage("block_table", inputs.block_table), backend=self.backend)
        return stage("input_ids", inputs.input_ids), stage("positions", inputs.positions), ctx

    @torch.inference_mode()
    def run(self, batch: SchedulerOutput, sampling: SamplingBatch, feed: Feed | None = None,
            copies: list[tuple[int, int]] | None = None, sample_from: np.ndarray | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, list]:
        """Launch one forward over the batch and its sampling -> the sampled token per sampling row (in batch
        order), raw logprobs and each beam group's candidates, all left on the device: on CUDA this returns before
        the kernels have run. feed: rows whose input token is still on the device (sampled by the step before, not
        yet landed). copies: KV blocks copied on write (source, destination) before the forward writes any.
        sample_from: which of the step's sampled rows each sampling row takes (continuations forked from one
        prompt take its row); None: its own."""
        inputs = step_inputs.build(batch, self.tables.array, self.config.block_size, self._steady_after(batch),
                                   feed is not None and feed.every_row)
        self._last_seqs, self._last_inputs = batch.seqs, inputs
        with self._in_lockstep():
            if self.shard.parallel:  # the other ranks run the same forward on their shards
                send_step(self.shard, inputs, copies)
            hidden = self._forward(inputs, copies, feed)
            if not len(inputs.sample_rows):
                return torch.empty(0, dtype=torch.long, device=self.device), torch.empty(0), []
            logits = self._logits(self._sampled(hidden, inputs))
        if sample_from is not None:
            logits = logits[self.staging.to_device("sample_from", sample_from)]
        tokens, logprobs, candidates = sample(logits, sampling, self.backend.argmax, self.staging)
        del logits, hidden  # freed here, in the phase that made them (a batch's logits can be hundreds of MB)
        self.times.lap("sample")
        return tokens, logprobs, candidates

    @contextlib.contextmanager
    def _in_lockstep(self) -> Iterator[None]:
        """The part of a step the other tensor-parallel ranks run too, meeting rank 0 in its collectives. Rank 0
        raising there would leave them waiting in a collective of a step it gave up, so the replica stops instead
        (its jobs' leases lapse and another worker resumes them); outside it (sampling) a step may fail and the
        engine go on."""
        try:
            yield
        except Exception as e:
            if not self.shard.parallel:
                raise
            fail(f"tensor parallelism: rank 0's part of a step failed ({type(e).__name__}: {e}): its ranks can no "
                 f"longer agree on the next step, so the replica stops")

    def follow_rank0(self) -> None:
        """A rank other than 0: run each step rank 0 sends, until it says stop."""
        while (step := recv_step(self.shard)) is not None:
            self.follow(*step)

    @torch.inference_mode()
    def follow(self, inputs: StepInputs, copies: list[tuple[int, int]]) -> None:
        """A rank other than 0: run the step rank 0 sent, and send it this shard's logits of the sampled rows."""
        hidden = self._forward(inputs, copies, None)
        if len(inputs.sample_rows):
            self._logits(self._sampled(hidden, inputs))

    def _forward(self, inputs: StepInputs, copies: list[tuple[int, int]] | None, feed: Feed | None
                 ) -> torch.Tensor:
        """The hidden states of the step's tokens (of a padded batch, its first rows)."""
        self.staging.next_step()
        if copies:
            pairs = np.array(copies, dtype=np.int64).T.copy()
            self.backend.copy_blocks(self.kv_cache, self.staging.to_device("copies", pairs))
        buffers = self.decode_buffers
        padded = buffers is not None and inputs.decode_only and len(inputs.seq_lens) <= buffers.max_size
        if padded:
            size = buffers.load(inputs, self.staging)
            input_ids = buffers.input_ids
        else:
            input_ids, positions, ctx = self._tensors(inputs)
        if feed is not None and feed.every_row:  # a decode step of the same requests: one copy
            input_ids[: len(feed.tokens)].copy_(feed.tokens)
        elif feed is not None:
            # A fed row has one new token, so its token row is where its query starts.
            rows = self.staging.to_device("fed_rows", inputs.query_start_loc[feed.rows].astype(np.int64))
            input_ids[rows] = feed.tokens[self.staging.to_device("fed_sources", feed.sources)]
        self.times.lap("prepare")
        if padded:
            hidden = self.graphs.replay(size) if self.graphs is not None else self.model(*buffers.inputs(size, self.backend))
        else:
            hidden = self.model(input_ids, positions, ctx)
        self.times.lap("forward")
        return hidden

    def _sampled(self, hidden: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        """Logits only where a token is sampled, never for the rest of a prompt. Decoding, every row samples: the
        first rows (of a padded batch) are the ones, with no index to copy."""
        if inputs.decode_only:
            return hidden[: len(inputs.seq_lens)]
        return hidden[self.staging.to_device("sample_rows", inputs.sample_rows)]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The logits of these rows; a tensor-parallel rank computes its vocabulary slice and rank 0 gathers them
        (None on the others)."""
        if self.shard.parallel:
            return self.shard.gather_logits(self.model.logits(hidden), self.hf_config.vocab_size)
        rows = hidden.shape[0]
        if self.logits_buffer is None or rows > self.logits_buffer.shape[0]:
            return self.model.logits(hidden)
        return self.model.lm_head(hidden, out=self.logits_buffer[:rows])

    def _steady_after(self, batch: SchedulerOutput) -> StepInputs | None:
        """The previous step's inputs if this step decodes the same sequences, in the same order, right after
        that step decoded them (each is then exactly one token further)."""
        last = self._last_inputs
        both_decode = last is not None and last.decode_only and batch.num_tokens == len(batch.seqs)
        return last if both_decode and batch.seqs == self._last_seqs else None

    def forget_steps(self, tables: BlockTables) -> None:
        """The engine dropped its requests (LLMEngine.reset): nothing of the steps before carries over, and the
        block tables are the new block manager's."""
        self.tables = tables
        self._last_seqs, self._last_inputs = None, None

    def to_host(self, tokens: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Start copying sampled tokens to the host -> (host tokens, an event to wait on, or None where they are
        there already). Queued right behind the step, so waiting for it never waits for a step launched after."""
        if tokens.device.type != "cuda":
            return tokens, None
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event
