"""Draft-model proposer: a smaller model (or the target quantized) runs ahead of the target, greedy, k tokens.

The draft has its own ModelRunner and its own small paged KV cache, with a shadow Sequence per target sequence. At
each step the shadow is brought up to the target's tokens: the longest common prefix of the two stays computed
(rejected drafts past it are trimmed), the rest is fed as a prefill chunk, whose last row gives the first draft
token; then k - 1 decode steps give the others, one forward per draft token for the whole batch. Greedy drafting
makes the draft a point mass, so the verify step's exact acceptance (engine.speculative.verify) holds unchanged.

A preempted target sequence needs nothing here: its shadow compares token lists, whatever the target recomputes.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.runner.model_runner import ModelRunner
from engine.runner.sampler import SamplingBatch
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence
from engine.weights.loader import resolve_model

log = logging.getLogger("pagedq.engine")

_GREEDY = SamplingParams(temperature=0)
_SPECIAL = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


def load_draft(config: EngineConfig, target: ModelRunner, tokenizer) -> ModelRunner:
    """The draft model of config.draft_model, loaded once for the engine's life, after a check that it shares the
    target's tokenizer. Its KV pool holds what the target's does, and a block more per sequence for the drafts
    (capped by max_num_seqs sequences of max_model_len)."""
    from transformers import AutoConfig, AutoTokenizer

    folder = resolve_model(config.draft_model, config.cache_dir)
    check_same_vocab(config.model, target.hf_config, tokenizer, config.draft_model, AutoConfig.from_pretrained(folder),
                     AutoTokenizer.from_pretrained(folder))
    bs = config.block_size
    cap = config.max_num_seqs * -(-(target.max_model_len + config.num_speculative_tokens) // bs)
    draft = dataclasses.replace(config, model=config.draft_model, quantization=config.draft_quantization,
                                num_kv_blocks=min(target.num_blocks + config.max_num_seqs, cap),
                                max_model_len=None, enable_prefix_caching=False, speculative="off",
                                draft_model=None)
    runner = ModelRunner(draft, folder)
    log.info("draft model %s: %d KV blocks", config.draft_model, runner.num_blocks)
    return runner


def check_same_vocab(target_name: str, target_cfg, target_tok, draft_name: str, draft_cfg, draft_tok) -> None:
    """Raise ValueError unless the draft's vocabulary is the target's: its token ids are fed to the target as they
    are. Checked: the vocabulary sizes, the special ids, and the text of ids spread over the vocabulary."""
    def fail(what: str, t, d) -> None:
        raise ValueError(f"draft model {draft_name!r} does not share the tokenizer of the target {target_name!r}: "
                         f"{what} {d!r} against {t!r}")

    if draft_cfg.vocab_size != target_cfg.vocab_size:
        fail("vocab_size", target_cfg.vocab_size, draft_cfg.vocab_size)
    if len(draft_tok) != len(target_tok):
        fail("tokenizer size", len(target_tok), len(draft_tok))
    for name in _SPECIAL:
        if getattr(draft_tok, name, None) != getattr(target_tok, name, None):
            fail(name, getattr(target_tok, name, None), getattr(draft_tok, name, None))
    n = len(target_tok)
    ids = sorted({0, 1, n // 7, n // 3, n // 2, n - 1})
    if draft_tok.convert_ids_to_tokens(ids) != target_tok.convert_ids_to_tokens(ids):
        fail(f"tokens of ids {ids}", target_tok.convert_ids_to_tokens(ids), draft_tok.convert_ids_to_tokens(ids))


class DraftProposer:
    # A draft token's cost in one-token target steps (Policy.draft_cost): SmolLM2-135M's Q4_1 GGUF decodes a token
    # in 0.45 of the float32 model's time on a Zen 4 CPU (96 and 43.5 tokens/s); a smaller draft costs less.
    step_cost = 0.45

    def __init__(self, runner: ModelRunner, block_size: int, max_num_batched_tokens: int,
                 num_blocks: int | None = None) -> None:
        """runner: the draft model (load_draft); a fresh proposer per engine build shares it, with its own blocks.
        num_blocks: of the runner's KV blocks, how many this one uses (None: all)."""
        self.runner = runner
        # No prefix caching: shadows are trimmed back and forth, and one prompt's prefill is cheap for a draft.
        self.bm = BlockManager(min(num_blocks or runner.num_blocks, runner.num_blocks), block_size,
                               enable_prefix_caching=False)
        runner.forget_steps(self.bm.tables)
        self.max_tokens = max_num_batched_tokens
        self.shadows: dict[Sequence, Sequence] = {}  # target sequence -> its shadow (insertion order: least recent first)

    def propose(self, wants: list[tuple[Sequence, int]]) -> list[list[int]]:
        # Positions go back between calls (rejected drafts): never the runner's shortcut from the call before.
        self.runner.forget_steps(self.bm.tables)
        wanted = {seq for seq, _ in wants}
        live: list[tuple[int, Sequence, int]] = []  # (index in wants, shadow, k)
        for i, (seq, k) in enumerate(wants):
            shadow, k = self._sync(seq, k, wanted)
            if shadow is not None:
                live.append((i, shadow, k))
        out: list[list[int]] = [[] for _ in wants]
        if not live:
            return out
        starts = {shadow: len(shadow.token_ids) for _, shadow, _ in live}
        self._catch_up([shadow for _, shadow, _ in live])
        for step in range(1, max(k for _, _, k in live)):
            self._decode([shadow for _, shadow, k in live if k > step])
        for i, shadow, k in live:
            start = starts[shadow]
            out[i] = shadow.token_ids[start:start + k]
        return out

    def finished(self, seq: Sequence) -> None:
        shadow = self.shadows.pop(seq, None)
        if shadow is not None:
            self.bm.free_seq(shadow)

    def _sync(self, seq: Sequence, k: int, wanted: set[Sequence]) -> tuple[Sequence | None, int]:
        """seq's shadow with seq's tokens, computed as far as they agree, and blocks for k drafts -> (shadow, k as
        the draft's length limit allows), or (None, 0) where the draft cannot run it this step."""
        tokens = seq.token_ids
        k = min(k, self.runner.max_model_len - len(tokens) + 1)  # the last draft is never computed
        if k < 1:
            return None, 0
        shadow = self.shadows.pop(seq, None)
        if shadow is None:
            shadow = Sequence(seq.request_id, [], _GREEDY)
            self.bm.allocate(shadow, 0, [])
        self.shadows[seq] = shadow  # most recent last: evicted last
        keep = min(shadow.num_computed_tokens, len(tokens) - 1)
        if shadow.token_ids[:keep] != tokens[:keep]:
            keep = _common_prefix(shadow.token_ids, tokens, keep)
        shadow.num_computed_tokens = keep
        self.bm.trim(shadow, keep)
        shadow.token_ids = list(tokens)
        need = self.bm.blocks_needed(len(tokens) + k - 1) - len(shadow.block_table)
        if need > self.bm.num_free_blocks:
            self._evict(need, wanted)
        if need > self.bm.num_free_blocks:
            return None, 0
        self.bm.append(shadow, len(tokens) + k - 1 - keep)
        return shadow, k

    def _evict(self, need: int, wanted: set[Sequence]) -> None:
        """Free the shadows of sequences not drafted this step, least recently drafted first, until `need` blocks
        are free (their sequences start over if drafted again)."""
        for seq in [s for s in self.shadows if s not in wanted]:
            if self.bm.num_free_blocks >= need:
                return
            self.finished(seq)

    def _catch_up(self, shadows: list[Sequence]) -> None:
        """Feed every shadow's uncomputed tokens, in forwards of at most max_num_batched_tokens; each shadow's last
        row gives its first draft token."""
        pending = shadows
        while pending:
            batch, budget, rest = SchedulerOutput(), self.max_tokens, []
            for shadow in pending:
                n = len(shadow.token_ids) - shadow.num_computed_tokens
                take = min(n, budget)
                if take > 0:
                    batch.seqs.append(shadow)
                    batch.num_new_tokens.append(take)
                    budget -= take
                if take < n:
                    rest.append(shadow)
            self._run(batch)
            pending = rest

    def _decode(self, shadows: list[Sequence]) -> None:
        """One more draft token for each shadow: one forward for all of them."""
        if shadows:
            self._run(SchedulerOutput(seqs=shadows, num_new_tokens=[1] * len(shadows)))

    def _run(self, batch: SchedulerOutput) -> None:
        """One greedy forward of the draft; the rows that reach their shadow's last token append their argmax."""
        samplers = [s for s, n in zip(batch.seqs, batch.num_new_tokens) if s.num_computed_tokens + n == s.num_tokens]
        tokens, _, _ = self.runner.run(batch, SamplingBatch.greedy())
        for shadow, n in zip(batch.seqs, batch.num_new_tokens):
            shadow.num_computed_tokens += n
        for shadow, token in zip(samplers, tokens.tolist()):
            shadow.token_ids.append(token)


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """The length of a's and b's common prefix, at most limit (a vectorized compare: prompts are long)."""
    differ = np.flatnonzero(np.asarray(a[:limit]) != np.asarray(b[:limit]))
    return int(differ[0]) if len(differ) else limit
