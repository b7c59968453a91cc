"""Building the C++ CPU kernels (pagedq_kernels/cpu_*.cpp) once per environment, safely.

The library is compiled with this machine's compiler for the CPU it runs on, into a folder named by a key of
everything the binary depends on: the sources and flags, the CPU's flags, the interpreter and environment, the
torch build and the compiler. Two virtual environments, or two CPUs behind one cache volume, get two folders.

Several processes may start at once on an empty cache (N worker replicas sharing one volume), and any of them may be
killed mid-build. So a build runs under an fcntl lock, which the OS releases when its holder dies, into a private
temporary folder that is renamed into place only once the library is whole: a folder under its final name is always
complete, and a killed build leaves nothing that blocks the next one (its temporary folder is removed by whoever
builds next). A process that finds the lock held waits for it, saying so, up to a bound, then gives up with an error
that names the folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger("pagedq.kernels")

HERE = Path(__file__).parent
SOURCES = [HERE / name for name in ("cpu_library.cpp", "cpu_attention.cpp", "cpu_prefill.cpp", "cpu_layers.cpp",
                                    "cpu_sampling.cpp", "cpu_linear.cpp", "cpu_quant.cpp", "cpu_model.cpp")]
HEADERS = [HERE / "cpu_math.h", HERE / "cpu_library.h", HERE / "cpu_model.h"]
# -march=native: the build is for this CPU (its flags are in the key), or for the lower ISA $PAGEDQ_KERNEL_MARCH
# names (x86-64-v3: AVX2 without AVX-512, to run those paths on a CPU that has more). Reassociating float sums lets
# the compiler vectorize the dot products; every sum is still accumulated in float32.
MARCH_ENV = "PAGEDQ_KERNEL_MARCH"
CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
          "-fno-signed-zeros", "-ffp-contract=fast"]
# How long a start waits for another process's build before it gives up (a build takes 1-3 minutes on 2 cores).
WAIT_ENV, WAIT_S = "PAGEDQ_KERNEL_BUILD_WAIT_S", 900.0
ROOT_ENV = "PAGEDQ_KERNELS_DIR"  # where built kernels live; default: the cache folder's kernels/


class BuildError(RuntimeError):
    """The kernels cannot be built here (no compiler, a compile error, a lock held too long): the message says why."""


def default_root(cache: Path) -> Path:
    """The folder built kernels go into: $PAGEDQ_KERNELS_DIR, else `cache`/kernels."""
    return Path(os.environ[ROOT_ENV]) if os.environ.get(ROOT_ENV) else cache / "kernels"


def cflags() -> list[str]:
    return [f"-march={os.environ.get(MARCH_ENV) or 'native'}", *CFLAGS]


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def _compiler_identity() -> str:
    path = shutil.which(_compiler())
    if path is None:
        return "none"
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    return f"{os.path.realpath(path)} {version.splitlines()[0] if version else ''}"


def build_key() -> str:
    """16 hex digits of everything the built library depends on."""
    torch_build = [torch.__version__, str(torch.version.git_version), str(torch.compiled_with_cxx11_abi()),
                   str(Path(torch.__file__).resolve().parent)]
    environment = [sys.version, sys.prefix, sysconfig.get_config_var("EXT_SUFFIX") or ""]
    parts = ([p.read_text() for p in SOURCES + HEADERS] + [" ".join(cflags()), _cpu_flags(), _compiler_identity()]
             + torch_build + environment)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def library_name(key: str) -> str:
    return f"pagedq_cpu_{key}"


def folder(root: Path, key: str) -> Path:
    return root / f"cpu-kernels-{key}"


def library(root: Path, key: str) -> Path:
    """Where the built library of `key` is once it is complete."""
    return folder(root, key) / f"{library_name(key)}.so"


def missing_tools() -> str | None:
    """Why nothing can be built here (no compiler, no ninja), or None."""
    if shutil.which(_compiler()) is None:
        return f"no C++ compiler ({_compiler()!r}) on PATH"
    # torch builds with ninja: the pip package's, next to this Python, when the environment is not activated.
    scripts = sysconfig.get_path("scripts")
    if shutil.which("ninja") is None and shutil.which("ninja", path=scripts):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    if shutil.which("ninja") is None:
        return "no ninja on PATH (pip install ninja)"
    return None


def ensure_built(root: Path, wait_s: float | None = None) -> tuple[Path, bool]:
    """The library for this environment under `root`, built first if missing -> (its path, whether this call built
    it). Raises BuildError with the reason where it cannot be had."""
    key = build_key()
    lib = library(root, key)
    if lib.exists():
        return lib, False
    why = missing_tools()
    if why:
        raise BuildError(why)
    wait_s = float(os.environ.get(WAIT_ENV, WAIT_S)) if wait_s is None else wait_s
    try:
        root.mkdir(parents=True, exist_ok=True)
        with _exclusive(root / f"cpu-kernels-{key}.lock", wait_s, folder(root, key)):
            if lib.exists():  # another process built it while this one waited
                return lib, False
            _compile(root, key)
    except OSError as e:  # a read-only or full cache
        raise BuildError(f"cannot build the CPU kernels in {folder(root, key)}: {e}") from e
    return lib, True


@contextlib.contextmanager
def _exclusive(lock_path: Path, wait_s: float, target: Path) -> Iterator[None]:
    """Hold an fcntl lock on lock_path (released by the OS if this process dies), waiting up to wait_s for it."""
    with open(lock_path, "a+") as f:
        deadline = time.monotonic() + wait_s
        said = False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not said:
                    log.info("another process is building the CPU kernels in %s: waiting for it (up to %.0f s)",
                             target, wait_s)
                    said = True
                if time.monotonic() >= deadline:
                    raise BuildError(f"gave up after {wait_s:.0f} s waiting for another process to build the CPU "
                                     f"kernels in {target} (lock {lock_path}; set {WAIT_ENV} to wait longer)") from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _compile(root: Path, key: str) -> None:
    """Build into a private folder, then rename it into place. Runs under the key's lock, so any other temporary
    folder of this key belongs to a build that died: it is removed first."""
    for stale in root.glob(f"cpu-kernels-{key}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f"cpu-kernels-{key}.tmp-{os.getpid()}"
    tmp.mkdir()
    log.info("building the CPU kernels for this CPU (first start in this environment only; about %d s on %d cores) "
             "in %s", _estimate_s(), os.cpu_count() or 1, folder(root, key))
    start = time.monotonic()
    from torch.utils import cpp_extension

    try:
        cpp_extension.load(name=library_name(key), sources=[str(p) for p in SOURCES], extra_cflags=cflags(),
                           extra_ldflags=["-fopenmp"], build_directory=str(tmp), is_python_module=False,
                           verbose=False)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        detail = str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)
        raise BuildError(f"the CPU kernels did not build: {detail}") from e
    final = folder(root, key)
    if final.exists():  # a folder without its library (emptied by hand): this build replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    log.info("built the CPU kernels in %.0f s", time.monotonic() - start)


def _estimate_s() -> int:
    # Measured: ~100 s of compile on one core of a 2-core EPYC, the sources compiled in parallel.
    return max(20, int(100 * 2 / max(1, min(len(SOURCES), os.cpu_count() or 1))))
