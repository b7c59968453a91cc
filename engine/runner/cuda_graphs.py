"""CUDA graphs for decode steps: one captured forward per padded batch size, replayed over static buffers.

A decode step of a small model is dozens of short kernel launches per layer; replaying a graph issues them all at
once. The padding and the buffers live in engine.runner.decode_buffers (device-agnostic); only capture and
replay are here.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.runner.decode_buffers import DecodeBuffers
from pagedq_kernels import Backend

log = logging.getLogger("pagedq.engine")


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, buffers: DecodeBuffers, backend: Backend) -> None:
        self.model = model
        self.buffers = buffers
        self.backend = backend
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every padded size, largest first, so that the smaller graphs reuse the largest one's memory."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.buffers.sizes):
            ids, positions, ctx = self.buffers.inputs(size, self.backend)
            # An eager run first: Triton compiles (and allocates its workspace) outside the capture.
            self.model(ids, positions, ctx)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model(ids, positions, ctx)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        log.info("captured %d decode CUDA graphs (batch sizes up to %d) in %.1f s", len(self.graphs),
                 self.buffers.max_size, time.perf_counter() - start)

    def replay(self, size: int) -> torch.Tensor:
        """Hidden states [size, hidden] of the batch loaded into the buffers; valid until the next replay."""
        self.graphs[size].replay()
        return self.outputs[size]
