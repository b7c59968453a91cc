"""`pagedq gpu-check` where there is no GPU: one clear line and a non-zero exit; and it never needs redis."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


def test_cli_without_gpu_says_so_and_fails(tmp_path):
    from cli import main

    out = tmp_path / "gpu.json"
    result = CliRunner().invoke(main, ["gpu-check", "--out", str(out)])
    assert result.exit_code != 0
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0], result.output
    assert not out.exists()


def test_module_runs_without_redis_or_click(tmp_path):
    # The GPU machine has torch, triton and transformers, and neither redis nor click.
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('redis', 'click', 'producer'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from bench.gpu_check import main\n"
        f"sys.exit(main(['--out', {str(tmp_path / 'g.json')!r}]))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr[-2000:]
    assert r.stdout.strip().splitlines() == [
        "gpu-check: no CUDA GPU here (torch.cuda.is_available() is False); nothing was measured"]


@pytest.mark.parametrize("section", ["graphs", "e2e"])
def test_sections_run_on_cpu(tiny_model, section):
    # A smoke run of the measuring code on a tiny model, so that the first GPU run does not trip on a typo.
    from bench import gpu_check

    path = tiny_model("llama")
    if section == "graphs":
        out = gpu_check.graph_speedup("cpu", path, batches=(1, 2), steps=3)
        assert set(out["speedup"]) == {"1", "2"}
    else:
        out = gpu_check.end_to_end("cpu", path, max_num_seqs=4, max_num_batched_tokens=256, quick=True)
        assert set(out["ratios"]) == {f"{w}: engine / {p}" for w in ("chat", "mixed") for p in ("hf-static", "hf-cb")}
        assert all(r["status"] == "ok" for r in out["runs"])
    data = {"device": "cpu", "torch": "-", "triton": "-", section: out}
    data["targets"] = gpu_check.targets(data)
    assert "target | measured | met" in gpu_check.table(data)


def test_compose_gpu_override_reserves_a_gpu_per_worker():
    yaml = pytest.importorskip("yaml")
    base = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    gpu = yaml.safe_load((ROOT / "docker-compose.gpu.yml").read_text())["services"]
    assert set(gpu) <= set(base)
    worker = gpu["worker"]
    assert worker["environment"]["PAGEDQ_DEVICE"] == "cuda"
    assert worker["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
