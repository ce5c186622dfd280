# Two commands on a fresh machine: `make run` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: run test lint api-fuzz bench bench-filter bench-sandbox bench-rl bench-ingest bench-synth bench-charts bench-moe-ep bench-moe bench-scheduler bench-grad-compress bench-lora bench-serve bench-variants bench-grammar clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PIP) install -q -e '.[dev,sandbox,rl,envs,bench,cluster]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

run: $(STAMP)
	$(PY) manage.py up

# The last line: the engine tests must collect without pytest-django and without importing
# Django at all (its fixtures live in the conftests of tests/apps, tests/e2e and tests/browser),
# so a Django import in an engine or its tests fails CI.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy
	$(PY) manage.py makemigrations --check --dry-run
	$(PY) -c "import sys, pytest; rc = pytest.main(['-q', '-p', 'no:django', '--collect-only', 'tests/workers']); sys.exit(rc or ('django' in sys.modules and 'an engine test imported Django'))" >/dev/null

# Tests keep their state (SQLite file, broker spool, objects) in var/test, wiped each time.
# Everything the suite needs is installed first (each script only installs what is missing):
# the Python extras above, the sandbox's bubblewrap and toolchains, the browser tests' chromium.
test: $(STAMP)
	bash scripts/install_sandbox_deps.sh
	bash scripts/install_test_deps.sh
	rm -rf var/test
	CRUCIBLE_VAR_DIR=$(CURDIR)/var/test $(VENV)/bin/pytest --durations=25 $(PYTEST_ARGS)

# Schemathesis against a freshly seeded web process (fixed seed, bounded examples): 0 server
# errors and 0 schema violations, or it fails. A real session host serves the session routes. DATABASE_URL/REDIS_URL pick the configuration.
api-fuzz: $(STAMP)
	bash scripts/install_sandbox_deps.sh
	nice $(PY) scripts/api_fuzz.py

bench-sandbox: $(STAMP)
	bash scripts/install_sandbox_deps.sh
	$(PY) -m tests.benchmarks.bench_sandbox

bench-ingest: $(STAMP)
	nice $(PY) tests/benchmarks/bench_ingest.py

# The output filter (docs/filtering.md) against detect-secrets' own scanner.
bench-filter: $(STAMP)
	nice $(PY) -m tests.benchmarks.bench_filtering

bench: bench-ingest bench-filter bench-sandbox bench-rl bench-synth bench-charts bench-scheduler bench-moe-ep bench-moe bench-grad-compress bench-lora bench-serve bench-variants bench-grammar

# Constrained decoding (issue 23 item 3): llguidance, as the server uses it, against xgrammar,
# outlines-core and lm-format-enforcer. xgrammar's wheel requires triton (286 MB of GPU kernels
# its CPU matcher never imports), so it comes in here without dependencies, not in the extras.
bench-grammar: $(STAMP)
	$(PIP) install -q --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
	nice $(PY) -m tests.benchmarks.bench_grammar

bench-rl: $(STAMP)
	$(PY) -m tests.benchmarks.bench_rl

# 2-rank expert parallelism against 2-rank data parallelism on CPU (gloo), tiny Qwen3-MoE.
bench-moe-ep: $(STAMP)
	nice $(PY) -m tests.benchmarks.bench_moe_ep

# Expert balancing modes (aux loss, aux-free bias, none, global loss) on the tiny MoE:
# MaxVio and held-out reward, same seeds and steps (a few minutes on 2 cores).
bench-moe: $(STAMP)
	OMP_NUM_THREADS=1 nice $(PY) -m tests.benchmarks.bench_moe

bench-synth: $(STAMP)
	bash scripts/install_sandbox_deps.sh
	$(PY) -m tests.benchmarks.bench_synth

# The run page drawing 50 charts x 10,000 points in Debian's chromium (Playwright).
bench-charts: $(STAMP)
	nice $(PY) -m tests.benchmarks.bench_charts

# A discrete-event simulation of 1,000 GPUs / 10,000 jobs under today's policy and decide().
bench-scheduler: $(STAMP)
	$(PY) -m tests.benchmarks.bench_scheduler

# 4-bit gradient compression with error feedback: bytes on the wire vs fp32/bf16 and loss
# parity over 200 DDP steps of the tiny MoE on 2 gloo ranks (a few minutes on 2 cores).
bench-grad-compress: $(STAMP)
	OMP_NUM_THREADS=1 nice $(PY) -m tests.benchmarks.bench_grad_compress

# LoRA RL against full fine-tuning on the tiny Qwen3-MoE (and a 20M-parameter preset):
# trainable parameters, AdamW state and learner bytes, update and whole-loop step time.
bench-lora: $(STAMP)
	OMP_NUM_THREADS=1 nice $(PY) -m tests.benchmarks.bench_lora

# The OpenAI-compatible server (continuous batching, prefix cache) against `transformers serve`
# on the same checkpoint: tokens/s and p50/p95 latency at concurrency 1, 8, 32 for 256 requests
# (BENCH_SERVE_REQUESTS=N for fewer), and GRPO group sampling with and without prefix sharing.
bench-serve: $(STAMP)
	OMP_NUM_THREADS=1 nice $(PY) -m tests.benchmarks.bench_serve

# Speculative decoding (serve --ngram-draft / --draft-checkpoint) against plain greedy decoding
# of the same briefly trained checkpoint: tokens/s of a single stream, acceptance rates.
bench-variants: $(STAMP)
	OMP_NUM_THREADS=1 nice $(PY) -m tests.benchmarks.bench_variants

clean:
	rm -rf var/
