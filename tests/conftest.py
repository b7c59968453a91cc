# Triton kernels run under the interpreter on CPU; it must be set before any kernel module is imported.
import os as _os

_os.environ.setdefault("TRITON_INTERPRET", "1")

# ---- engine fixtures (issue 2): tiny random-weight models and the real default model ----
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model():
    """tiny_model(arch="llama") -> path of a small random-weight model, built once and cached on disk."""
    from tiny_model import cached_tiny_model

    return cached_tiny_model


@pytest.fixture(scope="session")
def make_engine(tiny_model):
    """make_engine(model="llama", **config) -> a new LLMEngine. `model` is a tiny random model's architecture
    (tests/tiny_model.py: built once, cached on disk) or any model path or name; `config`, EngineConfig's other
    fields. Every engine of the suite's fixtures is made here, so a new EngineConfig default reaches them all."""
    from bench.random_model import TINY_ARCHS
    from engine import EngineConfig, LLMEngine

    def make(model: str = "llama", **config) -> LLMEngine:
        path = tiny_model(model) if model in TINY_ARCHS else str(model)
        return LLMEngine(EngineConfig(model=path, **config))

    return make


@pytest.fixture(scope="module")
def engine(request, make_engine):
    """The module's engine on a tiny random llama, made once per test file: the file's
    `pytestmark = pytest.mark.engine(**config)` gives its EngineConfig fields (none: the defaults)."""
    mark = request.node.get_closest_marker("engine")
    return make_engine(*(mark.args if mark else ()), **(mark.kwargs if mark else {}))


@pytest.fixture(scope="session")
def smollm2(make_engine):
    """One SmolLM2-135M-Instruct engine shared by the tests that need a real model: its GGUF dequantized to float32
    (quantization="none"), the weights transformers runs, for exact greedy parity."""
    return make_engine("smollm2-135m-instruct", max_num_seqs=16, num_kv_blocks=512, quantization="none")
# ---- end of engine fixtures ----

# ---- producer / worker fixtures (issue 3): a real redis-server per session, a fresh queue per test ----
import os  # noqa: E402
import uuid  # noqa: E402

import pytest  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def quant_backend():
    """The CPU backend, where it has a quantized kernel (pagedq_kernels/cpu_quant.cpp); the test is skipped, saying why,
    where it has none. Its linear_paths["quantized"] names the path ("avx512_vnni", "avx2")."""
    from engine.weights.loader import cache_root
    from pagedq_kernels import build, get_backend

    backend = get_backend("auto", "cpu", build.default_root(cache_root()))
    if backend.name != "cpu":
        pytest.skip(f"no C++ CPU kernels here: {backend.fallback}")
    if "quantized" not in backend.linear_paths:
        pytest.skip("avx512_vnni, avx2: this CPU has neither AVX-512 VNNI nor AVX2, the quantized kernel's paths")
    return backend


@pytest.fixture(scope="session")
def redis_server():
    from worker.redis_server import RedisServer

    with RedisServer() as srv:
        yield srv


@pytest.fixture(scope="session")
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture
def queue() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def rds(redis_url):
    import redis

    r = redis.Redis.from_url(redis_url, decode_responses=True)
    yield r
    r.close()


@pytest.fixture(scope="session")
def pq_tiny_model(tiny_model) -> str:
    return tiny_model("llama")


@pytest.fixture
def start_worker(redis_url, tmp_path):
    """start_worker(queue, model, *flags) -> the Process (bench/harness.py) of `python -m cli worker ...`; stopped
    after the test."""
    import sys
    from pathlib import Path

    from bench.harness import Process

    procs = []

    def start(queue: str, model: str, *flags: str, env: dict | None = None, hooks: dict | None = None,
              url: str | None = None):
        """hooks: faults to inject ({"poison": MARK, "crash": MARK}, see tests/worker_hooks.py)."""
        launcher = [sys.executable, "-m", "cli", "worker"]
        if hooks:
            launcher = [sys.executable, str(Path(__file__).parent / "worker_hooks.py"),
                        *(f"--{k}={v}" for k, v in hooks.items()), "--"]
        cmd = [*launcher, "--redis-url", url or redis_url, "--queue", queue,
               "--model", model, "--device", "cpu", "--log-level", "INFO", *flags]
        p = Process(cmd, tmp_path / f"worker-{len(procs)}.log", env={**os.environ, **(env or {})}, name="worker")
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.stop(30) not in (0, -15):
            print(f"worker exited with {p.returncode}:\n{p.tail(5000)}")
# ---- end of producer / worker fixtures ----

# ---- fault tests (issue 5): helpers shared by tests/faults/ ----
@pytest.fixture(scope="session")
def pq_reference(make_engine):
    """pq_reference(requests) -> [(token_ids, text)] of an undisturbed run of the engine on JobRequests,
    with the worker's sampling parameters (its derived seeds included)."""
    from worker.validate import sampling_params

    eng = make_engine(max_num_seqs=16, num_kv_blocks=512, max_model_len=256)

    def run(reqs):
        outs = eng.generate([r.prompt for r in reqs], [sampling_params(r) for r in reqs])
        return [(o.token_ids, o.text) for o in outs]

    return run


@pytest.fixture
def pq_check_stream():
    """pq_check_stream(client, result) -> number of token events: asserts the job's event stream holds its
    tokens exactly once, in order, then exactly one terminal event, last."""
    from producer.flows import parse_event

    def check(client, res) -> int:
        events = [parse_event(eid, f) for eid, f in client.redis.xrange(client.keys.events(res.id))]
        assert events and events[-1].terminal, (res.id, [e.type for e in events])
        assert sum(e.terminal for e in events) == 1, (res.id, [e.type for e in events])
        toks = events[:-1]
        assert [t for e in toks for t in e.token_ids] == res.token_ids, res.id
        assert "".join(e.text for e in toks) == res.text, res.id
        return len(toks)

    return check
# ---- end of fault test helpers ----


# ---- cluster fixtures (issue 8) ----
@pytest.fixture(scope="session")
def redis_cluster():
    """A real Redis Cluster (3 masters, no replicas) for the session: `.urls`, `.node_of(key)`,
    `.queue_node(queue)`; tests/redis_cluster.py."""
    from redis_cluster import ClusterServers

    with ClusterServers() as cluster:
        yield cluster


@pytest.fixture
def cluster_queues(redis_cluster) -> list[str]:
    """Two fresh queue names whose slots live on different masters."""
    from redis_cluster import queues_on_different_masters

    return queues_on_different_masters(redis_cluster, 2)
# ---- end of cluster fixtures ----


# ---- serve fixtures (issue 12): `pagedq serve` as a subprocess on a free port ----
@pytest.fixture
def start_serve(redis_url, tmp_path):
    """start_serve(queue, *flags) -> base URL ("http://127.0.0.1:PORT") of a `pagedq serve` subprocess, once its
    /health answers; `.procs` lists the processes (bench/harness.py's Process: a test may kill one). Stopped after
    the test."""
    import sys

    from bench.harness import Process
    from worker.redis_server import free_port

    procs = []

    def start(queue: str, *flags: str, url: str | None = None) -> str:
        port = free_port()
        cmd = [sys.executable, "-m", "cli", "serve", "--redis-url", url or redis_url, "--queue", queue,
               "--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING", *flags]
        p = Process(cmd, tmp_path / f"serve-{len(procs)}.log", name="pagedq serve")
        procs.append(p)
        base = f"http://127.0.0.1:{port}"
        p.wait_healthy(f"{base}/health", timeout=60)
        return base

    start.procs = procs
    yield start
    for p in procs:
        if p.stop(15) not in (0, -15, -9):
            print(f"serve exited with {p.returncode}:\n{p.tail(5000)}")
# ---- end of serve fixtures ----


# ---- the run's header: the CPU and its kernel paths (issue 22) ----
def pytest_report_header(config) -> list[str]:
    """Which CPU this run is on and which kernel paths it tests: the suite runs on AMX Xeons and on AVX512_BF16 CPUs
    without AMX (Zen 4), and a path the CPU lacks is skipped by name (the summary's SKIPPED lines say why)."""
    from pathlib import Path

    try:
        info = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return ["cpu: unknown (no /proc/cpuinfo)"]
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in info.splitlines() if ":" in line)}
    model = fields.get("model name", "unknown")
    flags = set(fields.get("flags", "").split())
    isa = [name for name, flag in (("AMX", "amx_bf16"), ("AVX512_BF16", "avx512_bf16"), ("AVX-512", "avx512f"),
                                   ("AVX2", "avx2")) if flag in flags]
    lines = [f"cpu: {model} ({os.cpu_count()} cores): {', '.join(isa) or 'no AVX2'}"]
    try:
        from engine.weights.loader import cache_root
        from pagedq_kernels import build, cpu_ops

        why = cpu_ops.load(build.default_root(cache_root()))
    except Exception as e:  # the header must never stop the run
        why = repr(e)
    if why:
        lines.append(f"cpu kernels: not built ({why}): their tests fail")
    else:
        import torch

        paths = cpu_ops.linear_paths()
        linear = ", ".join(f"{d} on {paths.get(d, 'oneDNN (no panel path)')}" for d in ("float32", "bfloat16"))
        attention = "AMX tiles" if torch.ops.pagedq.decode_uses_amx() else "AVX-512 lanes" if "avx512f" in flags else "torch"
        lines.append(f"cpu kernels: linears {linear}; bfloat16 attention on {attention}")
    return lines


# ---- the quick loop: `pytest -m "not slow"` (`make quick`) ----
# A test that starts a worker, a server or a cluster, or loads the real model, takes seconds: it is slow by what
# it uses, so a new one is marked without anyone remembering to. Other slow tests carry @pytest.mark.slow.
SLOW_FIXTURES = {"start_worker", "start_serve", "redis_cluster", "cluster_queues", "smollm2", "dashboard",
                 "prometheus", "sentinels"}


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if SLOW_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)
