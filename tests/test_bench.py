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


def test_bench_command_smoke(tiny, tmp_path):
    from bench.cli import bench

    out = tmp_path / "results"
    res = CliRunner().invoke(bench, ["--model", tiny, "--device", "cpu", "--quick", "-w", "chat",
                                     "-s", "pagedq,hf-generate", "--out-dir", str(out), "--no-charts",
                                     "--no-progress"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert "chat: pagedq / HF one-at-a-time" in res.output
    data = json.loads((out / "bench.json").read_text())
    assert {"machine", "config", "results", "ratios", "matmul_peak", "params"} <= data.keys()
    assert {"cpu", "cpu_cores", "torch", "device"} <= data["machine"].keys()
    rows = {r["system"]: r for r in data["results"]}
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
