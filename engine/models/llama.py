"""The Llama family (Llama, Mistral, Qwen2, Qwen3): fused qkv and gate/up, GQA, tied or untied embeddings."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from engine.parallel.shard import Shard, split_heads
from engine.weights.checkpoint import dequantized, scheme
from engine.weights.names import SUFFIXES, fused
from engine.weights.packed import PanelLinear
from pagedq_kernels import Backend, torch_ops

SUPPORTED_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass
class AttnContext:
    """What every attention layer of one forward needs; built once per step by the model runner."""

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    backend: Backend
    # What a backend derives from this step's tensors once, for every layer (a planned backend takes it).
    plan: dict = field(default_factory=dict)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """The backend's paged_attention over this step's batch."""
        return self.backend.attend(q, k_cache, v_cache, self.query_start_loc, self.seq_lens, self.block_table, scale,
                                   self.plan)


def rope_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling, the way transformers computes them."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None) or {}
    if not params:
        params = dict(scaling)
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    base = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    partial = float(getattr(config, "partial_rotary_factor", 1.0) or 1.0)
    dim = int(head_dim * partial)
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    if rope_type == "default":
        return inv, 1.0
    if rope_type == "linear":
        return inv / float(params["factor"]), 1.0
    if rope_type == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    raise ValueError(f"rope type {rope_type!r} is not supported (supported: default, linear, llama3)")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fast = None  # see LlamaForCausalLM.use_fast_layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast is not None:
            return self.fast.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this norm of residual + x, residual + x): a sublayer's output added to the residual stream, which the
        fast path updates in place."""
        if self.fast is not None:
            return self.fast.add_rms_norm(x, residual, self.weight, self.eps), residual
        residual = residual + x
        return self(residual), residual


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the rotate-half layout; x [T, H, D], cos/sin [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


Rotary = Callable[[torch.Tensor], torch.Tensor]  # x [T, H, D] -> x rotated at each token's position


class Attention(nn.Module):
    """Self-attention over this rank's heads (all of them on one device): QKV column-parallel, o_proj row-parallel
    with one all-reduce."""

    def __init__(self, config, arch: str, shard: Shard) -> None:
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.heads = split_heads(total_heads, total_kv_heads, shard.size, shard.rank)
        self.num_heads, self.num_kv_heads = self.heads.q_count, self.heads.kv_count
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        self.shard = shard
        bias = arch == "Qwen2ForCausalLM" or bool(getattr(config, "attention_bias", False))
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        o_bias = bool(getattr(config, "attention_bias", False)) and arch != "Qwen2ForCausalLM"
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.qk_norm = arch == "Qwen3ForCausalLM"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, x: torch.Tensor, rotary: Rotary, ctx: AttnContext) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(q), rotary(k)
        ctx.backend.store_kv(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        o = ctx.attend(q, self.k_cache, self.v_cache, self.scale)
        return self.shard.all_reduce(self.o_proj(o.reshape(-1, self.q_size)))


class MLP(nn.Module):
    """SwiGLU over this rank's intermediate features: gate/up column-parallel, down row-parallel with one
    all-reduce."""

    def __init__(self, config, shard: Shard) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.span = shard.span(config.intermediate_size, "intermediate (MLP) features")
        self.inter = self.span.stop - self.span.start
        self.shard = shard
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.inter, bias=bias)
        self.down_proj = nn.Linear(self.inter, config.hidden_size, bias=bias)
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only silu)")
        self.fast = None  # see LlamaForCausalLM.use_fast_layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self.gate_up_proj, "activates", False):  # packed with SiLU-and-multiply fused in
            return self.shard.all_reduce(self.down_proj(self.gate_up_proj(x)))
        act = (self.fast or torch_ops).silu_and_mul(self.gate_up_proj(x))
        return self.shard.all_reduce(self.down_proj(act))


class VocabEmbedding(nn.Embedding):
    """The embedding rows of this rank's slice of the vocabulary [start, start + rows): a token outside it looks
    up zeros, and the all-reduce sums in the one rank that holds it."""

    def __init__(self, vocab_size: int, hidden_size: int, shard: Shard) -> None:
        self.start, rows = shard.vocab_span(vocab_size)
        super().__init__(rows, hidden_size)
        self.shard = shard

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.shard.parallel:
            return super().forward(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        h = super().forward(local.masked_fill(outside, 0))
        return self.shard.all_reduce(h.masked_fill(outside[:, None], 0))


class DecoderLayer(nn.Module):
    def __init__(self, config, arch: str, shard: Shard) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, arch, shard)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, shard)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, rotary: Rotary, ctx: AttnContext
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the previous layer's output, not yet in the residual stream (the embeddings, with residual None, before
        the first layer) -> this layer's, and the stream. Each add is fused with the norm after it."""
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm.add_and_norm(h, residual)
        x, residual = self.post_attention_layernorm.add_and_norm(self.self_attn(x, rotary, ctx), residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config, arch: str, shard: Shard) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, shard)
        self.layers = nn.ModuleList(DecoderLayer(config, arch, shard) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config, max_positions: int, shard: Shard | None = None) -> None:
        """shard: the slice of a tensor-parallel replica this rank holds; None: the whole model."""
        super().__init__()
        arch = (getattr(config, "architectures", None) or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHS)}")
        self.config = config
        self.shard = shard = shard or Shard()
        self.model = LlamaModel(config, arch, shard)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        # Vocab-parallel: this rank's rows of the logits (ModelRunner gathers them on rank 0).
        self.lm_head = nn.Linear(config.hidden_size, self.model.embed_tokens.num_embeddings, bias=False)
        self.bytes_read = 0  # weight bytes load_weights read: a rank reads its slices only
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight
        attn = self.model.layers[0].self_attn
        inv_freq, scaling = rope_inv_freq(config, attn.head_dim)
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)
        self.fast = None
        self.decoder = None  # the whole stack in one call a step (use_decoder)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        """Hidden states [T, hidden] of a flat token batch."""
        if self.decoder is not None:
            return self.decoder(input_ids, positions, ctx.slot_mapping, ctx.query_start_loc, ctx.seq_lens,
                                ctx.block_table, ctx.plan)
        h = self.model.embed_tokens(input_ids)
        if self.fast is not None:
            fast, positions = self.fast, positions.long()

            def rotary(x: torch.Tensor) -> torch.Tensor:
                return fast.rotary(x, positions, self.cos, self.sin)
        else:
            cos = self.cos[positions].to(h.dtype)[:, None, :]
            sin = self.sin[positions].to(h.dtype)[:, None, :]

            def rotary(x: torch.Tensor) -> torch.Tensor:
                return rotate(x, cos, sin)
        residual = None
        for layer in self.model.layers:
            h, residual = layer(h, residual, rotary, ctx)
        return self.model.norm(h) if residual is None else self.model.norm.add_and_norm(h, residual)[0]

    def use_fast_layers(self, fast) -> None:
        """RMSNorm, rotary and SiLU-and-multiply from `fast` (a Backend's layers, kernels.cpu_ops: one C++ pass each,
        the same roundings) instead of several torch ops each; None: the torch ops."""
        self.fast = fast
        for module in self.modules():
            if isinstance(module, (RMSNorm, MLP)):
                module.fast = fast

    def use_decoder(self, backend: Backend) -> bool:
        """Run the decoder stack as one call a step on the backend's kernels (kernels.cpu_ops.Decoder), where it has
        them: its fast layers in use, every linear on its weight panels, and attention kernels for these heads. Its
        outputs equal the layer-by-layer path's: the same ops in the same order. Call once the KV cache is in place.
        -> whether it is used. Not under tensor parallelism: its layers end in all-reduces, between C++ calls."""
        if self.shard.parallel:
            return False
        attn = self.model.layers[0].self_attn
        linears = [m for layer in self.model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                               layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        gated = {getattr(layer.mlp.gate_up_proj, "activates", False) for layer in self.model.layers}
        fits = (backend.decoder is not None and self.fast is backend.layers and len(gated) == 1
                and all(isinstance(m, PanelLinear) for m in linears)
                and backend.decoder.fits(attn.head_dim, attn.num_heads // attn.num_kv_heads))
        self.decoder = backend.decoder([self._layer_tensors(layer) for layer in self.model.layers],
                                       self.model.embed_tokens.weight, self.model.norm.weight, self.cos, self.sin,
                                       (self.config.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                        self.model.layers[0].mlp.inter, int(gated.pop())),
                                       self.model.norm.eps, attn.scale) if fits else None
        return self.decoder is not None

    @staticmethod
    def _layer_tensors(layer: DecoderLayer) -> dict[str, torch.Tensor | None]:
        attn, mlp = layer.self_attn, layer.mlp
        return {"input_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight,
                "qkv": attn.qkv_proj.packed, "qkv_bias": attn.qkv_proj.bias, "o": attn.o_proj.packed,
                "o_bias": attn.o_proj.bias, "gate_up": mlp.gate_up_proj.packed, "gate_up_bias": mlp.gate_up_proj.bias,
                "down": mlp.down_proj.packed, "down_bias": mlp.down_proj.bias,
                "q_norm": attn.q_norm.weight if attn.qk_norm else None,
                "k_norm": attn.k_norm.weight if attn.qk_norm else None,
                "k_cache": attn.k_cache, "v_cache": attn.v_cache}

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """In the model's dtype: the sampler upcasts what it needs to."""
        return self.lm_head(hidden)

    def load_weights(self, folder: Path) -> None:
        """Read this rank's slice of every weight: safetensors' get_slice reads only those bytes from the file, so a
        rank's memory holds its shard, never the whole model."""
        from safetensors import safe_open

        quantized = scheme(self.config)
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        files = sorted(Path(folder).glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors weights in {folder}")
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    if name.rpartition(".")[2] in SUFFIXES:  # a quantized linear's, never a float model's
                        if quantized:
                            continue  # below, dequantized
                        raise ValueError(f"{name} in {file.name}: a quantized checkpoint's tensor, but config.json has "
                                         "no quantization_config (an AutoGPTQ/AutoAWQ quantize_config.json beside it "
                                         "is not read): add it to config.json as transformers writes it")
                    loaded.add(self._load(params, name, f.get_slice(name), file.name))
        if quantized:  # AWQ/GPTQ linears as float, exactly (engine.weights.quantized keeps them quantized where it can)
            for name, weight in dequantized(folder, quantized):
                loaded.add(self._load(params, name, weight, f"the {quantized.name} checkpoint",
                                      exact=not name.startswith("lm_head.")))
        expected = {f"{n}#{s}" for n in params for s in self._shards_of(n)}
        if self.tied:
            expected = {e for e in expected if not e.startswith("lm_head.")}
        missing = expected - loaded
        if missing:
            raise ValueError(f"weights missing from {folder}: {sorted(missing)[:5]}")

    def _load(self, params: dict, name: str, weight, source: str, exact: bool = False) -> str:
        """Copy this rank's part of checkpoint tensor `name` (a safetensors slice, or a tensor) into its parameter ->
        the part loaded ("" for none). exact: the shape must match (a dequantized linear), where elsewhere a
        checkpoint's vocab may be padded."""
        if "rotary_emb" in name or (name == "lm_head.weight" and self.tied):
            return ""
        target, shard = fused(name)
        if target not in params:
            raise ValueError(f"unexpected weight {name!r} in {source}")
        param = params[target]
        tensor = self._read_slice(weight, name)
        with torch.no_grad():
            dest = param if shard is None else param[self._shard_slice(target, shard)]
            if exact and tensor is not None and tensor.shape != dest.shape:
                raise ValueError(f"{name} in {source} is {list(tensor.shape)}, the model's {list(dest.shape)}")
            if tensor is None or tensor.shape != dest.shape:  # none here, or the vocab's padding rows
                dest.zero_()
            if tensor is not None:
                dest[: tensor.shape[0]].copy_(tensor)
                self.bytes_read += tensor.numel() * tensor.element_size()
        return f"{target}#{shard}"

    def _read_slice(self, weight, name: str) -> torch.Tensor | None:
        """This rank's part of checkpoint tensor `name` (a safetensors slice): rows of a column-parallel weight,
        columns of a row-parallel one; a row-parallel bias on rank 0 only (None elsewhere: added once)."""
        shard = self.shard
        if not shard.parallel:
            return weight[:]
        module, is_bias = name.split(".")[-2], name.endswith(".bias")
        attn, mlp = self.model.layers[0].self_attn, self.model.layers[0].mlp
        dim, heads = attn.head_dim, attn.heads
        q_part = slice(heads.q_start * dim, (heads.q_start + heads.q_count) * dim)
        if module == "q_proj":
            return weight[q_part]
        if module in ("k_proj", "v_proj"):
            return weight[heads.kv_start * dim: (heads.kv_start + heads.kv_count) * dim]
        if module in ("gate_proj", "up_proj"):
            return weight[mlp.span]
        if module in ("embed_tokens", "lm_head"):
            start, rows = shard.vocab_span(self.config.vocab_size)
            return weight[start: min(start + rows, self.config.vocab_size)]
        if module in ("o_proj", "down_proj"):
            if is_bias:
                return weight[:] if shard.rank == 0 else None
            return weight[:, q_part if module == "o_proj" else mlp.span]
        return weight[:]  # norms: every rank holds them whole

    def _shards_of(self, name: str) -> list[int | None]:
        if ".qkv_proj." in name:
            return [0, 1, 2]
        if ".gate_up_proj." in name:
            return [0, 1]
        return [None]

    def _shard_slice(self, target: str, shard: int) -> slice:
        if ".qkv_proj." in target:
            attn = self.model.layers[0].self_attn
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:
            inter = self.model.layers[0].mlp.inter
            sizes = [inter, inter]
        start = sum(sizes[:shard])
        return slice(start, start + sizes[shard])
