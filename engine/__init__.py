"""The inference engine: paged KV cache, continuous batching, sampling. Knows nothing of Redis."""

from engine.config import EngineConfig
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured.constraints import Constraint

__all__ = ["Constraint", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    # LLMEngine pulls in torch and transformers; keep `import engine` light for config-only users.
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
