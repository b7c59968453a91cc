"""Several continuations of one prompt: a request with n > 1, best_of > 1 or beam search. The Group is the parent
request: it collects its continuations' results (as they stream, or whole at the end) into the request's last output.

The prompt is prefilled once, by the group's first sequence. When that has computed its last prompt token the group
forks: the other sequences share every block of it, the partly filled last one included, and each takes a copy of
a block only when it is about to write into one it shares (copy-on-write, BlockManager.prepare_write). A sampling
group's sequences then are plain sequences to the scheduler: each decodes with its own seed, and is preempted and
recomputed on its own. A beam group's are a gang (Sequence.gang): they step, and are preempted, together, forking
the beams worth keeping and dropping the others every step (engine.beam_search).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.beam_search import BeamSearch
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

_GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def child_seed(seed: int, index: int) -> int:
    """The seed continuation `index` samples with: the request's own for the first, so that n=1 is unchanged, and a
    splitmix64 mix of (seed, index) for the others. Continuation i of a request with seed s gives the same tokens as
    a single request with seed child_seed(s, i), whatever else shares the batch."""
    if index == 0:
        return seed
    x = (seed + index * _GOLDEN) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return (x ^ (x >> 31)) & 0x7FFFFFFFFFFFFFFF


@dataclass(eq=False)
class Group:
    request_id: str
    params: SamplingParams
    seqs: list[Sequence]  # the live ones: continuations in index order, or beams best first
    done: list[Sequence] = field(default_factory=list)  # finished continuations (sampling)
    forked: bool = False  # whether the prompt's sequence has forked into the others yet
    beams: BeamSearch | None = None
    finals: dict[int, RequestOutput] = field(default_factory=dict)  # index -> a streamed continuation's last output
    unreported: int = 0  # streamed continuations whose last output is still to come (the request ends at 0)

    def __post_init__(self) -> None:
        self.unreported = self.params.width

    @property
    def width(self) -> int:
        return self.params.width

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def streams(self) -> bool:
        return self.params.streams

    @property
    def is_beam(self) -> bool:
        return self.beams is not None

    def slots(self) -> int:
        """Sequences it holds in a batch, or will once it forks."""
        return len(self.seqs) if self.forked else self.width

    def ended(self, seq: Sequence) -> bool:
        """A sampling continuation ended -> whether the request reports now: it was the last of a request whose
        continuations are reported whole, at the end (best_of > n)."""
        self.seqs.remove(seq)
        self.done.append(seq)
        return not self.seqs and not self.streams

    def streamed_end(self, out: RequestOutput) -> bool:
        """A streamed continuation's last output -> whether it ends the request: then
        it is the request's last output and carries every continuation's last in `choices`."""
        self.finals[out.index] = out
        self.unreported -= 1
        if self.unreported:
            return False
        out.request_finished = True
        out.choices = [self.finals[i] for i in sorted(self.finals)]
        return True

    def returned(self) -> list[Sequence]:
        """A sampling group's n continuations to return, in index order: all of them, or the n of highest
        cumulative logprob of best_of (then numbered anew by rank)."""
        if self.params.streams:
            return sorted(self.done, key=lambda s: s.index)
        return sorted(self.done, key=lambda s: (-s.cumulative_logprob, s.index))[: self.n]
