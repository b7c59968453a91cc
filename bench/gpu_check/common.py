"""What every gpu-check section shares: the sections and their budgets, the exit statuses, a section's time
(Budget, sweep), the error tolerances, and the JSON's writing."""

from __future__ import annotations

import json
import math
import os
import time
import traceback
from pathlib import Path

SECTIONS = ("kernels", "bandwidth", "graphs", "e2e", "tensor_parallel")  # cheapest first: they run in this order
# seconds; ~5 minutes in all on an H200 (tensor_parallel runs only with --tensor-parallel-size above 1)
BUDGETS = {"kernels": 105, "bandwidth": 40, "graphs": 75, "e2e": 100, "tensor_parallel": 120}
OK, FAILED, USAGE, NO_GPU, SHORT = 0, 1, 2, 3, 4  # exit statuses
TOL = {"bfloat16": 2e-2, "float16": 2e-3, "float32": 1e-4}  # largest error over the largest reference magnitude


class Budget:
    """A section's time: a sweep asks before each case whether it is spent."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def spent(self) -> bool:
        return self.elapsed() >= self.seconds


def sweep(budget: Budget, items, result: dict, what: str = "cases"):
    """Yield items until the budget is spent; then note in result["stopped"] how far the sweep got."""
    items = list(items)
    for i, item in enumerate(items):
        if budget.spent():
            note = f"budget of {budget.seconds:g} s spent after {i} of {len(items)} {what}"
            result["stopped"] = f"{result['stopped']}; {note}" if result.get("stopped") else note
            return
        yield item


REPO = Path(__file__).resolve().parents[2]


def _tail(e: BaseException, frames: int = 4, packages: tuple[str, ...] = ()) -> list[str]:
    """The innermost frames of an exception's traceback (only those in `packages` of ours, when given), as
    'path:line in function', the path from the repository's root where it is in it."""
    out = []
    for f in traceback.extract_tb(e.__traceback__):
        path = Path(f.filename).resolve()
        rel = path.relative_to(REPO) if path.is_relative_to(REPO) else None
        if packages and (rel is None or rel.parts[0] not in packages):
            continue
        out.append(f"{rel or path.name}:{f.lineno} in {f.name}")
    return out[-frames:]


def _clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def _write(path: Path, data: dict) -> None:
    """Written after every section, so that a run cut short keeps what it measured."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_clean(data), indent=2) + "\n")
    os.replace(tmp, path)


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)

