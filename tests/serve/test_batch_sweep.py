"""One process at a time moves a batch on: the holder of its sweeper lease, which names the process and is renewed
while it lives; when that process dies another takes the lease over and the batch still finishes. The holder
reads only its open jobs' states each round, never the batch's items (its requests)."""

import json
import re
import time

import httpx
import openai
import redis
from faults import wait_for

from producer import flows
from producer.keys import BatchKeys
from serve import batches, files, progress
from serve.batch_lease import Holder
from serve.config import ServeConfig

WORKER_FLAGS = ("--max-num-seqs", "8", "--num-kv-blocks", "256", "--max-model-len", "512",
                "--served-model-name", "tiny")
LINES = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                     "body": {"model": "tiny", "messages": [{"role": "user", "content": f"Question {i}?"}],
                              "max_tokens": 3, "temperature": 0}}) for i in range(4)]


def held(base: str) -> float:
    return float(re.search(r"^pagedq_serve_batches_held (\S+)$", httpx.get(f"{base}/metrics").text, re.M).group(1))


def test_one_server_moves_a_batch_on_and_another_takes_over_when_it_dies(rds, queue, pq_tiny_model, start_worker,
                                                                      start_serve):
    bases = [start_serve(queue, "--model", "tiny") for _ in range(2)]
    pids = [p.pid for p in start_serve.procs]
    c = openai.OpenAI(base_url=f"{bases[0]}/v1", api_key="x", max_retries=0)
    f = c.files.create(file=("in.jsonl", "\n".join(LINES).encode()), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    lease = BatchKeys.sweeper(b.id)

    def holder_pid() -> int | None:
        token = rds.get(lease)
        return int(token.split(":")[1]) if token else None

    first = wait_for(holder_pid, 30, "a server to take the batch's lease")
    assert first in pids
    for _ in range(10):  # no worker yet: the batch stays open, and its holder keeps it
        time.sleep(0.3)
        assert holder_pid() == first
    mine = pids.index(first)
    assert wait_for(lambda: held(bases[mine]) >= 1, 10, "the holder to count the batch")

    start_serve.procs[mine].kill()
    second = wait_for(lambda: (lambda p: p if p not in (None, first) else None)(holder_pid()), 30,
                      "the other server to take the lease over")
    assert second == pids[1 - mine]
    start_worker(queue, pq_tiny_model, *WORKER_FLAGS)
    other = openai.OpenAI(base_url=f"{bases[1 - mine]}/v1", api_key="x", max_retries=0)
    done = wait_for(lambda: (lambda x: x.status == "completed" and x)(other.batches.retrieve(b.id)), 120,
                    "the batch to complete")
    assert done.request_counts.completed == 4
    assert [json.loads(x)["custom_id"] for x in other.files.content(done.output_file_id).text.splitlines()] == \
        [f"r{i}" for i in range(4)]
    assert not rds.exists(lease)  # given up once the batch ended


def test_a_round_reads_job_states_not_the_batchs_items(redis_url, queue):
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    cfg = ServeConfig(redis_url=redis_url, queue=queue)
    f = flows.drive(r, files.put("\n".join(LINES), "in.jsonl", "batch", 600))
    batch_id = flows.drive(r, batches.create(cfg, f["id"], "/v1/chat/completions"))["id"]
    keys = []

    def recorded(flow):
        reply = None
        while True:
            try:
                op = flow.send(reply)
            except StopIteration as stop:
                return stop.value
            keys.extend(str(a) for c in (op.cmds if isinstance(op, flows.Pipe) else [op])
                        for a in c.args if isinstance(op, (flows.Pipe, flows.Cmd)))
            reply = flows.execute(r, op)

    holder = Holder()
    for _ in range(3):
        recorded(progress.advance(batch_id, holder))
    assert any(k.startswith(f"pq:{{{queue}}}:job:{batch_id}-") for k in keys)  # the jobs' states
    assert BatchKeys.items(batch_id) not in keys
    assert flows.drive(r, batches.show(batch_id))["status"] == "in_progress"
    r.close()
