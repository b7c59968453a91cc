"""Where the figures go: a table on the terminal, one JSON file with every figure and the machine, PNG charts."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

from bench.systems import ALL, LABELS


def machine(device: str) -> dict:
    import torch
    import transformers

    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device,
        "memory_gib": _mem_gib(),
        "git_commit": _git_commit(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            return round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def table(results: list[dict], ratios: list[dict]) -> str:
    head = ["workload", "system", "reqs", "out tok", "time s", "out tok/s", "MFU", "TTFT p50/p99 ms",
            "TPOT p50/p99 ms", "check"]
    rows = []
    for r in results:
        label = LABELS.get(r["system"], r["system"])
        if r["status"] != "ok":
            rows.append([r["workload"], label, "", "", "", "", "", "", "", f"{r['status']}: {r['note']}"])
            continue
        check = "ok" if r["checked"] else f"{r['num_mismatched']} mismatched"
        if r.get("note"):
            check += f" ({r['note']})"
        mfu = r.get("mfu")
        rows.append([
            r["workload"], label, str(r["requests"]), str(r["output_tokens"]), f"{r['elapsed_s']:.1f}",
            f"{r['output_tokens_per_s']:.1f}", "-" if mfu is None else f"{mfu:.1%}",
            f"{_ms(r['ttft_p50_s'])}/{_ms(r['ttft_p99_s'])}", f"{_ms(r['tpot_p50_s'])}/{_ms(r['tpot_p99_s'])}",
            check,
        ])
    lines = _grid(head, rows)
    if ratios:
        lines += ["", *_grid(["target", "measured", "wanted", "result"],
                             [[q["name"], _ratio(q), f"{'<=' if q['kind'] == 'latency' else '>='} {_target(q)}",
                               q["result"].upper()] for q in ratios])]
    return "\n".join(lines)


def _ratio(q: dict) -> str:
    if q["value"] is None:
        return f"n/a ({q['why']})"
    return f"{q['value']:.1%}" if q["kind"] == "mfu" else f"{q['value']:.2f}x"


def _target(q: dict) -> str:
    return f"{q['target']:.0%}" if q["kind"] == "mfu" else f"{q['target']:g}x"


def _grid(head: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)] if rows else [len(h) for h in head]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*head), "  ".join("-" * w for w in widths), *(fmt.format(*r) for r in rows)]


def write_json(data: dict | list, out_dir: str | Path, name: str = "bench.json") -> Path:
    """data as out_dir/name (the folder made if need be) -> its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path


def charts(data: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    paths = []
    ok = [r for r in data["results"] if r["status"] == "ok"]
    title = f"{Path(data['config']['model']).name} on {_where(data['machine'])}"
    workloads = list(dict.fromkeys(r["workload"] for r in ok))
    systems = [s for s in ALL if any(r["system"] == s for r in ok)]
    if workloads and systems:
        fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(workloads)), 4.2))
        width = 0.8 / len(systems)
        for k, s in enumerate(systems):
            xs, ys = [], []
            for i, w in enumerate(workloads):
                hit = [r for r in ok if r["system"] == s and r["workload"] == w]
                if hit:
                    xs.append(i + (k - (len(systems) - 1) / 2) * width)
                    ys.append(hit[0]["output_tokens_per_s"])
            bars = ax.bar(xs, ys, width, label=LABELS[s])
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_ylabel("output tokens / s")
        ax.set_yscale("log")
        ax.set_title(f"Throughput: {title}", fontsize=10)
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(_save(fig, out_dir / "throughput.png"))
        plt.close(fig)
    measured = [q for q in data["ratios"] if q["value"] is not None]
    if measured:
        fig, ax = plt.subplots(figsize=(9, 0.5 * len(measured) + 1.5))
        # Each bar is measured / target (target / measured for a latency, where lower is better): past the
        # line at 1 the target is met.
        vals = [q["target"] / q["value"] if q["kind"] == "latency" else q["value"] / q["target"] for q in measured]
        colors = ["tab:green" if q["result"] == "pass" else "tab:red" for q in measured]
        bars = ax.barh([q["name"] for q in measured], vals, color=colors)
        ax.bar_label(bars, labels=[f"{_ratio(q)} (target {_target(q)})"
                                   for q in measured], fontsize=7, padding=3)
        ax.axvline(1.0, color="k", lw=1)
        ax.set_xlabel("measured / target")
        ax.set_xlim(0, max(vals + [1.0]) * 1.5)
        ax.invert_yaxis()
        ax.set_title(f"Targets: {title}", fontsize=10)
        fig.tight_layout()
        paths.append(_save(fig, out_dir / "targets.png"))
        plt.close(fig)
    online = [r for r in ok if r["workload"] == "online" and r.get("ttft_p50_s") is not None]
    if online:
        fig, axes = plt.subplots(1, 2, figsize=(8, 3.5))
        for ax, key in zip(axes, ("ttft", "tpot")):
            labels = [LABELS[r["system"]] for r in online]
            p50 = [r[f"{key}_p50_s"] * 1000 for r in online]
            p99 = [r[f"{key}_p99_s"] * 1000 for r in online]
            xs = range(len(online))
            ax.bar([x - 0.2 for x in xs], p50, 0.4, label="p50")
            ax.bar([x + 0.2 for x in xs], p99, 0.4, label="p99")
            ax.set_xticks(list(xs), labels, fontsize=8)
            ax.set_ylabel(f"{key.upper()} ms")
            ax.legend(fontsize=8)
        rate = data.get("online", {}).get("rate_per_s")
        fig.suptitle(f"Online, Poisson {rate:.2f} req/s: {title}" if rate else f"Online: {title}", fontsize=10)
        fig.tight_layout()
        paths.append(_save(fig, out_dir / "online.png"))
        plt.close(fig)
    return paths


def _where(m: dict) -> str:
    return m.get("gpu") or f"{m['cpu']}, {m['cpu_cores']} cores"


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=120)
    return path
