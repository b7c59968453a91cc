"""The launch path never makes the host wait for the device (issue 31): every step's inputs and sampling settings
reach the device through pinned staging buffers with non_blocking copies, nothing made from host data is copied
over or used as an index, and the host reads no device data until it lands a step. Checked on the CPU with the
sync tracer (tests/engine/sync_tracer.py) over the CUDA path's code: the Triton backend (under the interpreter), staged
copies as on CUDA, overlapped steps, padded decode; on a GPU, `pagedq gpu-check` runs the same loop under
torch.cuda.set_sync_debug_mode("error")."""

import numpy as np
import pytest
import torch
from sync_tracer import SyncTracer

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.runner.staging import Staging

PROMPTS = ["Hello there, how are you?", "The capital of France is", "a", "Once upon a time, in a land far away",
           "def fib(n):", "Q: What is 2 + 2?\nA:"]
# Every sampling path: greedy, seeded with top-k / top-p / min-p, penalties, min_tokens, logprobs, stop strings.
PARAMS = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
          SamplingParams(max_tokens=10, temperature=0.8, top_k=20, top_p=0.9, seed=3),
          SamplingParams(max_tokens=9, temperature=0.7, min_p=0.1, seed=4, ignore_eos=True),
          SamplingParams(max_tokens=11, temperature=0, repetition_penalty=1.3, presence_penalty=0.5,
                         frequency_penalty=0.2, ignore_eos=True),
          SamplingParams(max_tokens=8, temperature=0, min_tokens=6, logprobs=3),
          SamplingParams(max_tokens=12, temperature=0, stop=["\n"], ignore_eos=True)]


def traced_run(engine: LLMEngine) -> tuple[SyncTracer, list]:
    """Run PROMPTS to the end, the launch of every step traced (landing a step reads its tokens by design)."""
    engine.runner.staging = Staging(engine.runner.device, copies=True)  # what CUDA runs, here
    tracer = SyncTracer(staging=engine.runner.staging)
    launch = engine.loop.launch

    def traced_launch():
        with tracer:
            return launch()

    engine.loop.launch = traced_launch
    outs = engine.generate(PROMPTS, PARAMS)
    return tracer, [o.token_ids for o in outs]


def make(path: str, **kw) -> LLMEngine:
    cfg = dict(model=path, attention_backend="triton", max_num_seqs=8, max_num_batched_tokens=64, block_size=8,
               num_kv_blocks=64, max_model_len=256, overlap_steps=True)
    return LLMEngine(EngineConfig(**(cfg | kw)))


@pytest.mark.slow
@pytest.mark.parametrize("padded", [False, True], ids=["eager", "padded"])
def test_no_launch_waits_for_the_device(tiny_model, padded):
    engine = make(tiny_model("llama"))
    if padded:
        engine.runner.use_padded_decode(capture=False)  # the buffers CUDA graphs replay
    tracer, tokens = traced_run(engine)
    assert tracer.blocking == [], "\n".join(map(str, tracer.blocking))
    copies = [c for c in tracer.calls if c.what == "copy"]
    assert len(copies) > 20 and all(not c.blocking for c in copies)  # the inputs did come through staging
    reference = make(tiny_model("llama"), overlap_steps=False).generate(PROMPTS, PARAMS)
    assert tokens == [o.token_ids for o in reference]  # staged copies change nothing in what runs


@pytest.mark.slow
def test_the_tracer_catches_what_would_wait(tiny_model):
    engine = make(tiny_model("llama"))
    # The step loop as it was: a per-row setting made from a Python list on the device, and the sampled rows picked
    # with an index made from numpy.
    bad = {"__name__": "engine.runner.sampler"}
    exec("import numpy as np, torch\n"
         "def per_row(stage, name, values):\n"
         "    return torch.tensor(values, dtype=torch.float32)\n", bad)
    import engine.runner.sampler as sampler

    original = sampler._per_row
    sampler._per_row = bad["per_row"]
    try:
        tracer, _ = traced_run(engine)
    finally:
        sampler._per_row = original
    blocking = {(c.what, c.op, c.where.split(":")[0]) for c in tracer.blocking}
    assert blocking == {("create", "tensor", "engine.runner.sampler")}


def test_staging_keeps_two_steps_apart_and_grows():
    staging = Staging(torch.device("cpu"), copies=True)
    first = staging.host("ids", np.arange(5, dtype=np.int64))
    staging.next_step()
    second = staging.host("ids", np.arange(5, 10, dtype=np.int64))
    assert first.tolist() == [0, 1, 2, 3, 4] and second.tolist() == [5, 6, 7, 8, 9]  # step N's buffer untouched
    staging.next_step()
    big = staging.to_device("ids", np.arange(1000, dtype=np.int64))
    assert big.tolist() == list(range(1000)) and not staging.is_staged(big)  # a device tensor of its own
    table = staging.to_device("table", np.arange(6, dtype=np.int32).reshape(2, 3))
    assert table.shape == (2, 3) and table.dtype == torch.int32 and table.tolist() == [[0, 1, 2], [3, 4, 5]]
    plain = Staging(torch.device("cpu"))  # a CPU's default: numpy's memory is the tensor
    array = np.arange(3, dtype=np.int64)
    assert plain.to_device("x", array).data_ptr() == array.ctypes.data
