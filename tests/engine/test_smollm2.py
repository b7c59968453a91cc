"""The real default model gives a real answer."""

import pytest

from engine import SamplingParams

pytestmark = pytest.mark.slow


def test_capital_of_france(smollm2):
    ids = smollm2.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = smollm2.generate([ids], SamplingParams(max_tokens=32, temperature=0))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"


def test_chat_template_has_the_generation_prompt(smollm2):
    ids = smollm2.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert smollm2.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
