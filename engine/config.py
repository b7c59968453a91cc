"""Engine configuration: what a user sets, validated once."""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("float32", "bfloat16", "float16")
AUTO = "auto"  # bfloat16 on CUDA and on CPUs with bfloat16 matmul units (AVX-512 BF16, AMX); float32 elsewhere
BACKENDS = ("auto", "torch", "cpu", "triton")
QUANTIZATIONS = ("auto", "none", "int8", "int4")
SPECULATIVE = ("off", "ngram", "suffix", "draft")
# (max_num_seqs, max_num_batched_tokens) by device. CPU: measured with `pagedq bench` (docs/benchmarks.md, "vLLM as a peer"): a
# decode step reads every weight once whatever the batch, so more sequences per step amortize that read (mixed:
# +19% from 64 to 256 sequences); a step is a few hundred ms, so 4,096 tokens keep prefill chunks in step with it.
# CUDA: vLLM's own defaults for a single GPU, not yet measured here.
BATCH_LIMITS = {"cpu": (256, 4096), "cuda": (256, 8192)}
# What a step costs by its tokens, for the speculation policy (engine.speculative.policy), by the kind of forward:
# the tokens that double a one-token step's cost (EngineConfig.speculative_doubling_tokens), and the extra cost, in
# one-token steps, of a second token in a step of one (the CPU's quantized kernels turn from a matrix-vector product
# to int8 matrix products there). CPU: `python -m bench.step_costs` on SmolLM2-135M, 2-core AMD EPYC Zen 4 (float32:
# 1.02x a one-token step at 5 tokens, 1.63x at 17; Q4_1 blocks kept: 1.53x at 2 tokens, 3.13x at 17). CUDA: an
# H100-class GPU reads weights for about as long as it computes 200-300 tokens; not yet measured here.
DOUBLING_TOKENS = {"cpu": 16, "cpu-quantized": 10, "cuda": 256}
SECOND_TOKEN_COST = {"cpu-quantized": 0.5}


@dataclass
class EngineConfig:
    model: str = "smollm2-135m-instruct"
    device: str = "cpu"
    # None: bfloat16 on CUDA, float32 on CPU (exact greedy parity with a float32 reference). "auto": see AUTO.
    dtype: str | None = None
    block_size: int = 16
    # None: sized from kv_cache_memory (or, on a GPU, from gpu_memory_utilization).
    num_kv_blocks: int | None = None
    # None: BATCH_LIMITS for the device.
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    # None: the model's max_position_embeddings.
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # Preempt less urgent running requests for an urgent one that a full batch stops, else it waits them all out.
    preempt_for_priority: bool = True
    # "auto": Triton on CUDA; on a CPU the C++ decode attention ("cpu", compiled on first use), or "torch" where
    # there is no compiler.
    attention_backend: str = "auto"
    # True: never replay CUDA graphs for decode steps (they need the Triton backend on CUDA).
    enforce_eager: bool = False
    # CPU: bytes of KV cache when num_kv_blocks is None. None: a quarter of free memory, at most 2 GiB.
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.85
    # CPU, bfloat16: linear weights reordered once at load, for AMX tiles (engine.weights.packed.TileLinear) or else
    # oneDNN; faster.
    prepack_weights: bool = True
    # CPU, and the triton backend on a GPU: "auto" keeps a GGUF's block formats (pagedq_kernels/quant_layout.py READERS), or
    # an AWQ/GPTQ checkpoint's integers, quantized in memory (engine.weights.quantized); "none" dequantizes them to
    # float; "int8" makes weight-only per-channel int8 of any float model's weights, "int4" group-wise 4-bit (blocks
    # of 32, round to nearest).
    quantization: str = "auto"
    # Schedule and launch step N+1 while step N is still on the device (N's tokens fed to it there), so that all
    # host work of a step runs during a forward (LLMEngine.step). None: on for CUDA, where a forward runs
    # asynchronously; on a CPU the forward is synchronous, and overlap would only return every output a forward later.
    overlap_steps: bool | None = None
    cache_dir: str | None = None
    seed: int = 0
    # Tensor parallelism (engine.parallel.shard): one replica of the model over this many ranks, each holding a slice of
    # its heads, MLP features and vocabulary. Rank 0 is this engine; it starts the others of its host.
    tensor_parallel_size: int = 1
    # CPU: intra-op threads of each rank. None: the cores of the host shared evenly by its ranks.
    cpu_threads_per_rank: int | None = None
    # Ranks on several hosts: host:port of rank 0's rendezvous (torch.distributed's TCP store), this host's index,
    # and the number of hosts (each runs tensor_parallel_size / nnodes ranks).
    dist_init_addr: str | None = None
    node_rank: int = 0
    nnodes: int = 1
    # CPU ranks of one host: all-reduces through shared memory (engine.parallel.shm_all_reduce), not gloo's sockets.
    shm_all_reduce: bool = True
    # Speculative decoding (engine.speculative): "ngram" proposes up to num_speculative_tokens tokens per sequence
    # per step by prompt lookup, verified in the same forward; the output is the same, token for token (seeded
    # sampling too). "suffix": prompt lookup, else what the worker's recent outputs did after the same text
    # (speculative.suffix). "draft": a draft model (draft_model, sharing the target's tokenizer; its weights as
    # draft_quantization says, with quantization's choices) proposes them, greedy (engine.speculative.draft). "off":
    # one token per sequence per step.
    speculative: str = "off"
    num_speculative_tokens: int = 8
    draft_model: str | None = None
    draft_quantization: str = "auto"
    # The tokens a step takes on before it costs twice a one-token step (engine.speculative.policy): drafts fill
    # steps below that, and a batch that is past it gets none. None: DOUBLING_TOKENS for the device and weights.
    speculative_doubling_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.dtype is None:
            self.dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        elif self.dtype == AUTO:
            self.dtype = "bfloat16" if self.device.startswith("cuda") or cpu_has_bf16() else "float32"
        seqs, tokens = BATCH_LIMITS.get(self.device.split(":")[0], BATCH_LIMITS["cpu"])
        self.max_num_seqs = seqs if self.max_num_seqs is None else self.max_num_seqs
        self.max_num_batched_tokens = tokens if self.max_num_batched_tokens is None else self.max_num_batched_tokens
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES} or {AUTO!r}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {BACKENDS}, got {self.attention_backend!r}")
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1 or None, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        self._check_parallel()
        self._check_speculative()

    def _check_speculative(self) -> None:
        if self.speculative not in SPECULATIVE:
            raise ValueError(f"speculative must be one of {SPECULATIVE}, got {self.speculative!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if self.speculative_doubling_tokens is not None and self.speculative_doubling_tokens < 1:
            raise ValueError(f"speculative_doubling_tokens must be >= 1, got {self.speculative_doubling_tokens}")
        if self.speculative == "draft" and not self.draft_model:
            raise ValueError('speculative="draft" needs draft_model: the draft model\'s alias, folder or .gguf file')
        if self.draft_quantization not in QUANTIZATIONS:
            raise ValueError(f"draft_quantization must be one of {QUANTIZATIONS}, got {self.draft_quantization!r}")
        if self.speculative == "off":
            return
        # A step's drafts are read from its sequences' tokens, and checked against its own tokens when it lands:
        # the step before must have landed, and the other ranks would need the drafts too.
        if self.overlap_steps:
            raise ValueError("speculative decoding does not combine with overlap_steps yet: give one or the other")
        if self.tensor_parallel_size > 1:
            raise ValueError("speculative decoding does not combine with tensor_parallel_size > 1 yet")
        self.overlap_steps = False

    def _check_parallel(self) -> None:
        size = self.tensor_parallel_size
        if size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
        if self.nnodes < 1 or size % self.nnodes:
            raise ValueError(f"nnodes must be >= 1 and divide tensor_parallel_size {size}, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("ranks on several hosts need dist_init_addr (host:port of node 0's rendezvous)")
        if self.cpu_threads_per_rank is not None and self.cpu_threads_per_rank < 1:
            raise ValueError(f"cpu_threads_per_rank must be >= 1, got {self.cpu_threads_per_rank}")
        if size > 1 and self.quantization in ("int8", "int4"):
            # Quantized panels are made from whole rows; the ranks load slices (engine.runner.model_runner).
            raise ValueError(f"quantization {self.quantization} does not combine with tensor parallelism yet: give one "
                             "or the other")
        if size > 1:
            # The other ranks take a step's input ids from its message, not from the device: no overlap yet.
            if self.overlap_steps:
                raise ValueError("overlap_steps is not supported with tensor_parallel_size > 1")
            self.overlap_steps = False


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX), where oneDNN runs it at about twice
    the float32 rate; elsewhere bfloat16 is emulated and slower than float32."""
    import torch

    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")  # private, hence probed, not assumed
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


DEFAULT_MODEL = EngineConfig.model  # what every command and benchmark runs unless told otherwise
