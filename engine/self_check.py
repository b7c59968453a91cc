"""The engine's self check: one tiny greedy request alone on an empty engine. A step that fails on it too has no
request to blame: the device, the model or the engine is broken."""

from __future__ import annotations

from typing import Protocol

from engine.sampling_params import SamplingParams

SELF_CHECK_ID = "pagedq-self-check"
SELF_CHECK_STEPS = 8


class Engine(Protocol):
    """What the check needs of an engine (engine.llm_engine.LLMEngine, which imports this module)."""

    def has_unfinished_requests(self) -> bool: ...
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None: ...
    def step(self) -> list: ...
    def reset(self) -> list[str]: ...


def self_check(engine: Engine) -> str | None:
    """Run the check request on engine, then reset it -> None if it passed, else its error."""
    if engine.has_unfinished_requests():
        raise RuntimeError("self_check runs on an empty engine")
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    try:
        engine.add_request(SELF_CHECK_ID, prompt_token_ids=[0], params=params)
        for _ in range(SELF_CHECK_STEPS):
            if not engine.has_unfinished_requests():
                return None
            engine.step()
        return f"a {params.max_tokens}-token request did not finish in {SELF_CHECK_STEPS} steps"
    except Exception as e:  # noqa: BLE001 (any error is the answer)
        return f"{type(e).__name__}: {e}"
    finally:
        engine.reset()
