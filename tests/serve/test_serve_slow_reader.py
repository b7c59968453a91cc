"""A streaming client that does not read cannot make `pagedq serve` hold its job's events without end: past
--stream-buffer-events or --stream-buffer-bytes its stream is dropped (the connection closes, the drop is
counted) and its job goes on as if the client had left: to its end with an Idempotency-Key, cancelled without.
Real processes (redis-server, a worker on a tiny model, serve), and a Subscription on its own."""

import asyncio
import json
import re
import socket

import httpx
import pytest
from faults import wait_for

from producer import Client
from producer.protocol import StreamEvent
from serve.events import Bound, Dropped, Subscription
from serve.metrics import ServeMetrics

WORKER_FLAGS = ("--max-num-seqs", "8", "--num-kv-blocks", "512", "--max-model-len", "2048",
                "--served-model-name", "tiny")
TOKENS = 1500  # streamed with their 20 top logprobs: megabytes of chunks, far more than the sockets take in


def stream_without_reading(base: str, headers: dict) -> socket.socket:
    """POST a streamed chat request and read nothing. Its socket asks for small segments and a small receive
    buffer, so that the kernels on both ends hold little of what the server writes (on loopback a send buffer
    grows to megabytes with 64 KiB segments): the server's own buffers must fill, as over a real network."""
    host, port = base.removeprefix("http://").split(":")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    s.connect((host, int(port)))
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "Talk."}], "max_tokens": TOKENS,
                       "ignore_eos": True, "temperature": 0, "stream": True, "logprobs": True,
                       "top_logprobs": 20}).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": host, "Content-Type": "application/json",
                                                 "Content-Length": len(body), **headers}.items())
    s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\n{head}\r\n".encode() + body)
    return s


def read_to_end(s: socket.socket) -> bytes:
    """What the server sent before it closed the connection."""
    s.settimeout(60)
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    s.close()
    return out


def drops(base: str) -> float:
    m = re.search(r"^pagedq_serve_stream_drops_total (\S+)$", httpx.get(f"{base}/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_reader_that_does_not_read_is_dropped(redis_url, queue, pq_tiny_model, start_worker, start_serve):
    start_worker(queue, pq_tiny_model, *WORKER_FLAGS)
    base = start_serve(queue, "--model", "tiny", "--stream-buffer-events", "64", "--stream-buffer-bytes", "65536")
    kept = f"slow-{queue}"
    s = stream_without_reading(base, {"Idempotency-Key": kept})
    wait_for(lambda: drops(base) == 1, 300, "the slow reader to be dropped")
    sent = read_to_end(s)  # the server closed the stream mid-way
    assert sent.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in sent
    with Client(redis_url, queue=queue) as c:
        res = c.result(kept, timeout=300)  # with its Idempotency-Key, the job ran on to its end
        assert res.status == "completed" and len(res.token_ids) == TOKENS
        # Without one, the job is cancelled, as when a client leaves.
        s = stream_without_reading(base, {})
        wait_for(lambda: drops(base) == 2, 300, "the second slow reader to be dropped")
        job = re.search(rb'"id":"chatcmpl-([^"]+)"', read_to_end(s)).group(1).decode()
        assert c.result(job, timeout=120).status == "cancelled"
    # The server streams on for everyone else.
    r = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


class _Reader:
    def __init__(self) -> None:
        self.metrics = ServeMetrics()
        self.removed: list[Subscription] = []

    def remove(self, sub: Subscription) -> None:
        self.removed.append(sub)


def token(i: int) -> tuple[StreamEvent, int]:
    return StreamEvent(type="token", text=str(i)), 100


@pytest.mark.parametrize("bound", [Bound(events=3, bytes=10**6), Bound(events=10**6, bytes=250)])
def test_a_subscription_past_its_bound_is_dropped(bound):
    async def run() -> None:
        reader = _Reader()
        sub = Subscription(reader, "events-key", None, bound)
        for i in range(10):  # rounds of one event each, none read
            sub.put([token(i)])
            if sub.closed:
                break
        assert sub.dropped.is_set() and sub.closed and reader.removed == [sub]
        assert i <= 3 and sub.held == 0  # dropped once past its bound; what it held is freed at once
        assert reader.metrics.registry.get_sample_value("pagedq_serve_stream_drops_total") == 1
        with pytest.raises(Dropped):
            await sub.next()

    asyncio.run(run())


def test_a_subscription_that_is_read_holds_on_whatever_a_round_brings():
    async def run() -> None:
        sub = Subscription(_Reader(), "events-key", None, Bound(events=4, bytes=1000))
        for r in range(20):
            sub.put([token(10 * r + i) for i in range(10)])  # a round past the bound: the request reads it next
            assert [e.text for e in sub.ready()] == [str(10 * r + i) for i in range(10)]
        assert not sub.dropped.is_set() and sub.held == 0
        sub.put([token(i) for i in range(10)])
        sub.put([token(10)])  # not read since the last round, and past the bound
        assert sub.dropped.is_set()

    asyncio.run(run())


def test_a_subscription_skips_chunks_written_again_after_a_failover():
    """The worker writes again the chunks a promoted replica lacked, after those the reader had from the old
    primary: the request gets each token once, from the backlog and the reader's rounds alike."""

    def chunk(offset: int, *ids: int) -> StreamEvent:
        return StreamEvent(type="token", text="".join(map(str, ids)), token_ids=list(ids), offset=offset)

    async def run() -> None:
        sub = Subscription(_Reader(), "events-key", None)
        sub.backlog = [chunk(0, 0, 1), chunk(2, 2)]
        sub.put([(chunk(3, 3, 4), 10), (chunk(3, 3, 4), 10), (chunk(5, 5), 10)])  # 3-4 again: the failover's
        assert [e.text for e in sub.ready()] == ["01", "2", "34", "5"]
        sub.put([(chunk(5, 5), 10), (chunk(6, 6), 10), (StreamEvent(type="done"), 10)])
        assert [(await sub.next()).text for _ in range(2)] == ["6", ""]

    asyncio.run(run())
