"""Model code: one flat batch of tokens from many sequences, no padding, attention through `kernels`."""

from engine.models.llama import SUPPORTED_ARCHS, LlamaForCausalLM

__all__ = ["SUPPORTED_ARCHS", "LlamaForCausalLM"]
