"""The worker's publisher: writes each engine step's outputs to Redis, in a process of its own.

In a thread of the worker, its Python (detokenizing, JSON, packing commands, reading replies) held the GIL that
the step loop needs between its torch calls: through Redis a decode step at 256 sequences spent twice the host
time it spends without Redis. On a GPU the step loop is nothing but host work, so every millisecond of it counts.
Its parts, by role:

- handle.Publisher, the step loop's side: hands each step's new tokens over a pipe (a few plain values per job,
  written by a feeder thread so that the loop never waits on the pipe), and counts finished jobs until they are
  written, since they hold intake room until then.
- process, the publisher process: follows each job (job_view.JobView: its decoder, its output so far, all that
  its result says of it), turns each step's message into StepOutput records and hands them to the writer.
- writer.RedisWriter, a thread of that process: writes whatever piled up in one pipelined round trip (token
  events, results, acks) and reports to the worker's metrics (writer.WriterMetrics).

What crosses the pipe is in messages: a record per message, one encoder and one decoder.
"""

from worker.publisher.handle import DIED, Publisher

__all__ = ["DIED", "Publisher"]
