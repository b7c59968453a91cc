"""`docker compose up` end to end on a real Docker engine: `make compose-test` (the README says how to get one).

The stack as users run it (docker-compose.yml, the Dockerfile) under a random project name and free host ports:
it builds, comes up healthy, answers an OpenAI SDK chat through serve, runs jobs from a host client, restarts a
crashed worker while the other resumes its jobs, and drains on `stop`. Where the engine reaches no image registry,
the base images are stand-ins built from Debian packages (deploy/standin/build.sh); where the build reaches no
PyTorch index, the host's pip wheel folders are served to it. Minutes long: it runs only when PAGEDQ_COMPOSE_TEST=1
(make compose-test sets it), and skips with the reason where no Docker engine runs."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from producer import Client, wire

ROOT = Path(__file__).resolve().parents[2]
BASE_IMAGES = ("python:3.11-slim", "redis:7")
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu/"
BUILD_S = 1800  # a bare build: Debian packages, torch, our dependencies, the CPU kernels
UP_S = 600  # the worker healthcheck's own start period

pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("compose"),
    pytest.mark.skipif(os.environ.get("PAGEDQ_COMPOSE_TEST") != "1",
                       reason="builds and runs the compose stack (minutes): `make compose-test` runs it"),
]


def run(*cmd: str, timeout: float = 120, check: bool = True, **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=check, **kw)


def wait_for(what: str, check: Callable[[], Any], timeout: float, every: float = 2.0) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if got := check():
            return got
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout:.0f} s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reachable(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=10).close()
        return True
    except OSError:
        return False


def docker_engine() -> None:
    """Skips, saying why, unless a Docker engine answers."""
    if not shutil.which("docker"):
        pytest.skip("no docker command: apt-get install docker.io (README: Docker end to end)")
    info = run("docker", "info", "--format", "{{.ServerVersion}}", check=False, timeout=30)
    if info.returncode != 0:
        pytest.skip(f"no Docker engine answers (`dockerd &` as root starts one): {info.stderr.strip()[:200]}")


def compose_command() -> list[str]:
    if run("docker", "compose", "version", check=False).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    pytest.skip("neither `docker compose` nor docker-compose is installed")


def base_images() -> None:
    """The images the Dockerfile and compose file start from: pulled, or stand-ins where no registry answers."""
    missing = [i for i in BASE_IMAGES if run("docker", "image", "inspect", i, check=False).returncode != 0]
    if missing and all(run("docker", "pull", i, check=False, timeout=300).returncode == 0 for i in missing):
        return
    if missing:
        if not shutil.which("debootstrap") or os.geteuid() != 0:
            pytest.skip(f"{', '.join(missing)} cannot be pulled and no stand-in can be built (needs root and "
                        "debootstrap: deploy/standin/build.sh)")
        run("sh", str(ROOT / "deploy/standin/build.sh"), timeout=1200)


def bridge_gateway() -> str:
    """The host's address as build containers see it (the default bridge's gateway)."""
    out = run("docker", "network", "inspect", "bridge", "--format", "{{(index .IPAM.Config 0).Gateway}}")
    return out.stdout.strip() or "172.17.0.1"


def pip_setting(name: str) -> str:
    """This host's pip setting NAME (find-links, cert, ...): its environment variable, else its config."""
    if value := os.environ.get(f"PIP_{name.upper().replace('-', '_')}"):
        return value
    got = run(sys.executable, "-m", "pip", "config", "get", f"global.{name}", check=False)
    return got.stdout.strip() if got.returncode == 0 else ""


@contextlib.contextmanager
def pip_for_the_build() -> Iterator[dict[str, str]]:
    """pip settings for the image's build, as this host's pip has them: its wheel folder (find-links, or
    PAGEDQ_COMPOSE_WHEELS) served over HTTP; PyPI trusted without a certificate check where this host's pip needs a
    CA of its own (a TLS-intercepting proxy, whose CA the build lacks); PyPI's torch where PyTorch's CPU index is
    out of reach (the served folder should then hold a CPU torch)."""
    env: dict[str, str] = {}
    trusted = ["pypi.org", "files.pythonhosted.org"] if pip_setting("cert") else []
    if not reachable(TORCH_CPU_INDEX):
        env["TORCH_INDEX_URL"] = ""
    wheels = os.environ.get("PAGEDQ_COMPOSE_WHEELS") or pip_setting("find-links")
    folders = [f for f in wheels.split() if Path(f).is_dir()]
    if not folders:
        yield env | ({"PIP_TRUSTED_HOST": " ".join(trusted)} if trusted else {})
        return
    host, port = bridge_gateway(), free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", host,
                               "--directory", folders[0]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for("the wheel server", lambda: reachable(f"http://{host}:{port}/"), 30, every=0.5)
        yield env | {"PIP_FIND_LINKS": f"http://{host}:{port}/", "PIP_TRUSTED_HOST": " ".join([host, *trusted])}
    finally:
        server.terminate()
        server.wait(10)


class Stack:
    """One compose project: its settings, its host ports, and the commands on it."""

    def __init__(self, compose: list[str]) -> None:
        self.project = f"pqtest{secrets.token_hex(3)}"
        self.password = secrets.token_hex(16)
        self.api_key = f"sk-{secrets.token_hex(12)}"
        self.ports = {name: free_port() for name in ("REDIS", "SERVE", "DASHBOARD")}
        self.env_file = Path(tempfile.mkdtemp()) / "env"  # empty: no .env of the checkout's user reaches the test
        self.env_file.write_text("")
        self.compose = [*compose, "-p", self.project, "--project-directory", str(ROOT), "-f",
                        str(ROOT / "docker-compose.yml"), "--env-file", str(self.env_file)]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("PAGEDQ_", "REDIS_", "PIP_"))}
        self.env |= {"REDIS_PASSWORD": self.password, "PAGEDQ_API_KEYS": self.api_key, "PAGEDQ_BIND": "127.0.0.1",
                     "PAGEDQ_WORKERS": "2", "PAGEDQ_NUM_KV_BLOCKS": "512", "PAGEDQ_MAX_NUM_SEQS": "16",
                     "COMPOSE_HTTP_TIMEOUT": "300"}
        self.env |= {f"PAGEDQ_{name}_PORT": str(port) for name, port in self.ports.items()}
        if run("docker", "buildx", "version", check=False).returncode != 0:
            self.env.setdefault("DOCKER_BUILDKIT", "0")  # no buildx plugin: the legacy builder

    def __call__(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        done = run(*self.compose, *args, timeout=timeout, check=False, env=self.env)
        if check and done.returncode != 0:
            raise AssertionError(f"compose {' '.join(args)}: rc {done.returncode}\n{done.stdout[-3000:]}"
                                 f"\n{done.stderr[-3000:]}")
        return done

    @property
    def redis_url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.ports['REDIS']}/0"

    @property
    def serve_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['SERVE']}"

    def containers(self, service: str) -> list[str]:
        return self("ps", "-q", service).stdout.split()

    def state(self, container: str, field: str) -> str:
        return run("docker", "inspect", "-f", "{{" + field + "}}", container).stdout.strip()

    def healthy(self, service: str, count: int) -> bool:
        states = [self.state(c, ".State.Health.Status") for c in self.containers(service)]
        return states.count("healthy") == count

    def started(self, service: str, count: int) -> bool:
        """healthy(), failing at once where a container exits while starting, rather than at the start period's end."""
        for container in self.containers(service):
            if int(self.state(container, ".RestartCount")) or self.state(container, ".State.Status") == "exited":
                logs = run("docker", "logs", "--tail", "40", container, check=False)
                raise AssertionError(f"{service} exited while starting:\n{logs.stdout}{logs.stderr}"[-4000:])
        return self.healthy(service, count)

    def client(self) -> Client:
        return Client(self.redis_url, queue="default")

    def logs(self) -> str:
        return self("logs", "--no-color", "--tail", "60", check=False).stdout[-12000:]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    docker_engine()
    compose = compose_command()
    base_images()
    stack = Stack(compose)
    try:
        with pip_for_the_build() as build_env:
            stack.env |= build_env
            stack("build", "models", timeout=BUILD_S)
        stack("up", "-d", "--scale", "worker=2", timeout=UP_S)
        wait_for("serve healthy", lambda: stack.started("serve", 1), UP_S)
        wait_for("both workers healthy", lambda: stack.started("worker", 2), UP_S, every=5)
        yield stack
    except BaseException:
        print(stack.logs())
        raise
    finally:
        stack("down", "-v", "--remove-orphans", timeout=300, check=False)


def test_defaults_bind_to_this_host_only(stack):
    published = run("docker", "ps", "--filter", f"label=com.docker.compose.project={stack.project}",
                    "--format", "{{.Ports}}").stdout
    assert "127.0.0.1:" in published and "0.0.0.0:" not in published, published
    for container in stack.containers("worker") + stack.containers("serve"):
        assert stack.state(container, ".Config.User") == "pagedq"


def test_openai_sdk_chat_through_serve(stack):
    openai = pytest.importorskip("openai")
    api = openai.OpenAI(base_url=f"{stack.serve_url}/v1", api_key=stack.api_key, max_retries=0, timeout=300)
    model = api.models.list().data[0].id
    reply = api.chat.completions.create(model=model, max_tokens=12, temperature=0,
                                        messages=[{"role": "user", "content": "Say hello."}])
    assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
    stranger = openai.OpenAI(base_url=f"{stack.serve_url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()


def submit(client: Client, count: int, max_tokens: int) -> list:
    return [client.submit(prompt=f"Count to {i + 3}.", max_tokens=max_tokens, ignore_eos=True) for i in range(count)]


def test_twenty_jobs_from_the_host(stack):
    jobs = submit(stack.client(), 20, 16)
    results = [job.result(timeout=300) for job in jobs]
    assert [r.status for r in results] == ["completed"] * 20, [r.error for r in results]
    assert all(r.usage.completion_tokens == 16 for r in results)
    assert len({r.worker for r in results}) == 2  # the even spread: both idle workers took part


def running_on(client: Client, jobs: list, container_id: str) -> bool:
    """Whether one of JOBS is running on the worker in that container (a worker's id starts with its hostname,
    which Docker sets to the container id's first 12 characters)."""
    holders = [client.redis.hmget(client.keys.job(j.id), wire.F_STATE, wire.F_WORKER) for j in jobs]
    return any(state == "running" and (worker or "").startswith(container_id[:12]) for state, worker in holders)


def crash(container: str) -> None:
    """SIGKILL the container's process from outside, as the kernel's OOM killer does: a crash, which the restart
    policy answers. (`docker kill` is a deliberate stop to Docker: no restart policy starts the container again.)"""
    pid = int(run("docker", "inspect", "-f", "{{.State.Pid}}", container).stdout)
    assert pid > 0
    os.kill(pid, 9)


def test_a_crashed_worker_restarts_and_its_jobs_complete(stack):
    client = stack.client()
    victim = stack.containers("worker")[0]
    jobs = submit(client, 8, 96)
    wait_for("a job running on the first worker", lambda: running_on(client, jobs, victim), 120, every=0.2)
    restarts = int(stack.state(victim, ".RestartCount"))
    crash(victim)
    results = [job.result(timeout=600) for job in jobs]
    assert [r.status for r in results] == ["completed"] * 8, [r.error for r in results]
    wait_for("the crashed worker restarted",
             lambda: int(stack.state(victim, ".RestartCount")) > restarts and stack.healthy("worker", 2), UP_S, 5)


def test_stop_drains(stack):
    client = stack.client()
    jobs = submit(client, 6, 64)
    wait_for("jobs running", lambda: sum(client.status(j.id) == "running" for j in jobs) >= 2, 120, every=0.2)
    running = [j for j in jobs if client.status(j.id) == "running"]
    stack("stop", "worker", timeout=120)
    assert all(client.status(j.id) == "completed" for j in running), "a running job did not finish in the drain"
    assert all(client.status(j.id) in ("completed", "queued") for j in jobs)  # the rest wait for a worker
    stack("start", "worker")
    assert [j.result(timeout=600).status for j in jobs] == ["completed"] * 6
