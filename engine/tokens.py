"""What the engine reads from a model's tokenizer and generation config: its end-of-sequence ids, chat prompts."""

from __future__ import annotations

import contextlib


def eos_ids(folder, hf_config, tokenizer) -> set[int]:
    """The model's end-of-sequence token ids: its generation config's, else its model config's, else the
    tokenizer's."""
    from transformers import GenerationConfig

    ids = None
    with contextlib.suppress(OSError):
        ids = GenerationConfig.from_pretrained(folder).eos_token_id
    if ids is None:
        ids = getattr(hf_config, "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return set()
    return set(ids) if isinstance(ids, (list, tuple)) else {int(ids)}


def chat_prompt(tokenizer, model_name: str, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """The prompt token ids of a chat, by the model's template. ValueError for no messages, a malformed one, or a
    model without a template."""
    if not messages:
        raise ValueError("messages is empty: give at least one message")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"model {model_name!r} has no chat template: send a plain prompt instead")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError("each message needs a 'role' and a 'content'")
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)
