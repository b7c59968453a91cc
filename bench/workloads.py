"""Workloads: deterministic request sets, built from a seed and the model's tokenizer.

Each request carries both a text prompt and its token ids. The ids are what every in-process system consumes;
the text (whose encoding is exactly those ids) is what the Redis path sends, so every system sees the same input.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

NAMES = ("chat", "mixed", "online", "shared-prefix", "single")

# Per workload: number of requests, prompt length range, output length range (tokens, inclusive), and for
# shared-prefix the length of the common system prompt. `quick` is a smoke configuration, not a measurement.
FULL = {
    "chat": {"n": 64, "prompt": (50, 50), "output": (100, 100)},
    "mixed": {"n": 128, "prompt": (16, 512), "output": (16, 256)},
    "online": {"n": 64, "prompt": (50, 50), "output": (100, 100)},
    "shared-prefix": {"n": 64, "prompt": (20, 20), "output": (64, 64), "prefix": 400},
    # One request alone: an interactive user at low load, where a step's fixed cost, not the batch, sets the pace.
    "single": {"n": 1, "prompt": (64, 64), "output": (256, 256)},
}
QUICK = {
    "chat": {"n": 6, "prompt": (40, 40), "output": (12, 12)},
    "mixed": {"n": 6, "prompt": (16, 96), "output": (6, 24)},
    "online": {"n": 6, "prompt": (40, 40), "output": (12, 12)},
    "shared-prefix": {"n": 6, "prompt": (12, 12), "output": (8, 8), "prefix": 96},
    "single": {"n": 1, "prompt": (16, 16), "output": (12, 12)},
}


@dataclass(frozen=True)
class Request:
    id: str
    prompt: str
    prompt_ids: list[int]
    max_tokens: int


@dataclass
class Workload:
    name: str
    requests: list[Request]
    seed: int
    # Seconds after the start at which each request arrives; None: all at once (offline).
    arrivals: list[float] | None = None
    rate: float | None = None
    spec: dict = field(default_factory=dict)

    @property
    def online(self) -> bool:
        return self.name == "online"

    def with_poisson(self, rate: float) -> Workload:
        """The same requests arriving as a Poisson process of `rate` requests per second."""
        rng = random.Random(self.seed + 7919)
        t, arrivals = 0.0, []
        for _ in self.requests:
            arrivals.append(t)
            t += rng.expovariate(rate)
        return Workload(self.name, self.requests, self.seed, arrivals, rate, self.spec)


def build(name: str, tokenizer, quick: bool = False, num_requests: int | None = None, seed: int = 0) -> Workload:
    """The request set of workload `name`; `num_requests` overrides its size (scaling knob for slow machines)."""
    if name not in NAMES:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(NAMES)}")
    spec = dict((QUICK if quick else FULL)[name])
    if num_requests is not None:
        spec["n"] = num_requests
    # Each workload draws from its own stream, so that scaling one leaves the others unchanged.
    rng = random.Random(f"{seed}:{name}")
    words = _words(tokenizer)
    chat = bool(getattr(tokenizer, "chat_template", None))
    system = _text(words, rng, spec["prefix"], tokenizer) if "prefix" in spec else None
    requests = []
    for i in range(spec["n"]):
        plen = rng.randint(*spec["prompt"])
        out = rng.randint(*spec["output"])
        if name in ("mixed", "single") or not chat:
            prompt = _text(words, rng, plen, tokenizer)
        else:
            prompt = _chat(words, rng, plen, tokenizer, system)
        # Encoded as the worker encodes a text prompt, so that the Redis path gets these very ids.
        ids = list(tokenizer.encode(prompt))
        requests.append(Request(f"{name}-{i}", prompt, ids, out))
    return Workload(name, requests, seed, spec=spec)


def _words(tokenizer) -> list[str]:
    # Whole lowercase words that are single tokens with a leading space: a prompt of k of them is ~k tokens.
    vocab = tokenizer.get_vocab()
    marked = sorted(t for t in vocab if re.fullmatch(r"Ġ[a-z]{3,10}", t))
    if len(marked) >= 100:
        return [" " + t[1:] for t in marked]
    return [f" w{i}" for i in range(1000)]  # a tokenizer without byte-level markers


def _text(words: list[str], rng: random.Random, length: int, tokenizer) -> str:
    """Random words whose encoding is as close to `length` tokens as word boundaries allow."""
    picked = [rng.choice(words) for _ in range(length)]
    for _ in range(8):
        n = len(tokenizer.encode("".join(picked).lstrip(), add_special_tokens=False))
        if n == length:
            break
        if n > length and len(picked) > 1:
            del picked[-max(1, (n - length) // 2):]
        else:
            picked += [rng.choice(words) for _ in range(max(1, length - n))]
    return "".join(picked).lstrip()


def _chat(words: list[str], rng: random.Random, length: int, tokenizer, system: str | None) -> str:
    """A chat-template prompt of about `length` tokens in all (the template's own tokens counted)."""
    messages = [{"role": "system", "content": system}] if system else []
    frame = tokenizer.apply_chat_template(messages + [{"role": "user", "content": ""}], tokenize=False,
                                          add_generation_prompt=True)
    overhead = len(tokenizer.encode(frame, add_special_tokens=False))
    # shared-prefix: `length` is the question alone; chat: the whole prompt.
    budget = length if system else max(4, length - overhead)
    user = _text(words, rng, budget, tokenizer)
    return tokenizer.apply_chat_template(messages + [{"role": "user", "content": user}], tokenize=False,
                                         add_generation_prompt=True)
