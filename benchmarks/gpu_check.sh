#!/usr/bin/env bash
# GPU correctness + timing in one go (a few minutes on one GPU). Run from anywhere:
#
#     bash benchmarks/gpu_check.sh            # outputs under ./gpu_out
#     OUT=/some/dir bash benchmarks/gpu_check.sh
#
# 1. environment: nvidia-smi; a Python with CUDA torch + triton + this package. Uses $PYTHON if
#    set, else the venv $GPU_VENV (default ./.venv-gpu, created with --system-site-packages so a
#    preinstalled CUDA torch is reused). Installs only what is missing, with pip: torch==2.13.0
#    (a CUDA build on a GPU machine), then `pip install -e .[test]`, then triton==3.9.0.
# 2. correctness: pytest -q -m gpu tests/gpu (kernel parity at real shapes, greedy losslessness of
#    the speculative methods with the kernels active, kernel path == torch path).
# 3. timing: per-layer attention kernels (benchmarks/kernel_timing.py), then the step benchmark
#    `python -m cluster.speed --shape llama-3.1-8b --random-weights ...` (16K-64K, batch 1), then
#    paired end-to-end ar vs sparsespec-l (k=auto, k=4) at batch 1, 4, 16 x 16K-64K
#    (benchmarks/paired_e2e.py; random weights, so alpha is not a real model's; cells that do
#    not fit in memory are reported as such).
#
# Sizes and limits (environment; defaults are the full check):
#   GPU_CONTEXTS=16384,32768,65536   context lengths of the three timing steps
#   GPU_E2E_BATCHES=1,4,16           batch sizes of the paired end-to-end step
#   GPU_STEP_TIMEOUT=150             seconds per step (0: none); a step past it counts as failed, so
#                                    the whole check ends within about 10 minutes (one device call)
#   GPU_WHEELS=                      a folder of wheels installed (no index) into a private target
#                                    first: the packages an offline image lacks (on the H200 image:
#                                    sqlalchemy, greenlet, alembic, mako; see benchmarks/RESULTS.md)
# 4. vLLM on the GPU (issue 29): records whether that Python has `vllm` (its version), which the
#    `vllm:*` sweep methods need on GPU workers (cluster.peers). Timing them needs real weights on
#    the machine; this script does not carry any.
#
# Offline GPU images (no package index): point PYTHON at the image's python3; this checkout is
# put on PYTHONPATH, so nothing is installed when the image already has torch, triton, pytest,
# transformers and safetensors.
#
# Everything lands in $OUT: env.txt, nvidia-smi.txt, pytest.log, pytest.xml (and, when tests
# failed, pytest_alone.log: each failed test rerun in its own process, since a device fault
# poisons the process), kernels.{log,json}, bench.{log,json}, e2e.{log,json}, summary.txt.
# Launch configurations of the verify kernel are tried one per process by
# benchmarks/kernel_configs.py (not part of this check). Exit status: 1 if correctness failed (or no GPU/env),
# 2 if only a timing step failed, 0 otherwise.
set -euo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu_out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"

export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
CONTEXTS="${GPU_CONTEXTS:-16384,32768,65536}"
E2E_BATCHES="${GPU_E2E_BATCHES:-1,4,16}"
STEP_TIMEOUT="${GPU_STEP_TIMEOUT:-150}"
step() { if [ "$STEP_TIMEOUT" -gt 0 ]; then timeout --kill-after=10 "$STEP_TIMEOUT" "$@"; else "$@"; fi; }

log() { echo "[$(date -u +%Y-%m-%dT%H:%M:%SZ)] $*" | tee -a "$SUMMARY"; }

log "gpu_check start in $(pwd), outputs in $OUT"
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1; then
    log "FAIL: nvidia-smi missing or failing (no GPU?)"
    exit 1
fi
log "GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)"

# ---------------------------------------------------------------- environment
check_env() {
    "$1" - <<'EOF' 2>/dev/null
import torch, triton, pytest, transformers, safetensors  # noqa: F401
import sparsespec.engine, cluster.speed.measure  # noqa: F401
assert torch.cuda.is_available()
EOF
}
PY="${PYTHON:-}"
if [ -n "${GPU_WHEELS:-}" ]; then
    SITE="$(mktemp -d "${TMPDIR:-/tmp}/sparsespec-gpu-site.XXXXXX")"  # not under $OUT: that comes back
    log "installing the wheels in $GPU_WHEELS (no index) into $SITE"
    "${PY:-python3}" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$GPU_WHEELS"/*.whl
    export PYTHONPATH="$PYTHONPATH:$SITE"
fi
if [ -z "$PY" ]; then
    VENV="${GPU_VENV:-.venv-gpu}"
    if [ ! -x "$VENV/bin/python" ]; then
        log "creating $VENV (system site packages visible)"
        python3 -m venv --system-site-packages "$VENV"
    fi
    PY="$(cd "$VENV" && pwd)/bin/python"
fi
if ! check_env "$PY"; then
    log "installing what is missing into $PY"
    if ! "$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
        "$PY" -m pip install -q "torch==2.13.0" 2>&1 | tail -3 | tee -a "$SUMMARY" || true
    fi
    "$PY" -m pip install -q -e ".[test]" 2>&1 | tail -3 | tee -a "$SUMMARY" || true
    "$PY" -c "import triton" 2>/dev/null || { "$PY" -m pip install -q "triton==3.9.0" 2>&1 | tail -3 | tee -a "$SUMMARY" || true; }
fi
if ! check_env "$PY"; then
    log "FAIL: no Python with CUDA torch + triton + sparsespec (see above)"
    exit 1
fi
"$PY" - >"$OUT/env.txt" 2>&1 <<'EOF' || true
import platform, torch, triton
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "triton", triton.__version__, "device", torch.cuda.get_device_name())
EOF
"$PY" -m pip freeze >>"$OUT/env.txt" 2>/dev/null || true
log "env: $(head -1 "$OUT/env.txt")"
unset SPARSESPEC_ATTENTION TRITON_INTERPRET || true

# ---------------------------------------------------------------- correctness
status=0
log "correctness: pytest -q -m gpu tests/gpu"
if step "$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider --junitxml="$OUT/pytest.xml" 2>&1 | tee "$OUT/pytest.log"; then
    log "correctness: PASS ($(tail -1 "$OUT/pytest.log"))"
else
    log "correctness: FAIL ($(tail -1 "$OUT/pytest.log"))"
    status=1
    # a device fault (illegal address) poisons the CUDA context, so every later test in that
    # process fails too: run each failed test alone to see which ones fail on their own
    grep -E "^FAILED " "$OUT/pytest.log" | sed -E 's/^FAILED ([^ ]+).*/\1/' >"$OUT/failed.txt" || true
    : >"$OUT/pytest_alone.log"
    while read -r test_id; do
        one="$(step "$PY" -m pytest -q -p no:cacheprovider "$test_id" 2>&1)" && ok=1 || ok=0
        printf '%s\n' "$one" >>"$OUT/pytest_alone.log"
        if [ "$ok" -eq 1 ]; then
            log "  alone: PASS $test_id"
        else
            log "  alone: FAIL $test_id ($(printf '%s\n' "$one" | grep -m1 -oE "[A-Za-z]+Error: .{0,120}"))"
        fi
    done <"$OUT/failed.txt"
fi
if grep -q "skipped" "$OUT/pytest.log" && ! grep -q "passed" "$OUT/pytest.log"; then
    log "correctness: everything skipped: FAIL"
    status=1
fi

# ---------------------------------------------------------------- timing
log "timing: attention kernels per layer (benchmarks/kernel_timing.py)"
if step "$PY" benchmarks/kernel_timing.py --shape llama-3.1-8b --dtype bfloat16 --context-lengths "$CONTEXTS" --graphs \
        --json-out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"; then
    log "timing: kernels done"
else
    log "timing: kernel_timing FAILED"
    [ "$status" -eq 0 ] && status=2
fi

log "timing: python -m cluster.speed (llama-3.1-8b shape, random weights, bf16, $CONTEXTS, batch 1, steps only)"
if step "$PY" -m cluster.speed --shape llama-3.1-8b --random-weights --device cuda --dtype bfloat16 \
        --context-lengths "$CONTEXTS" --batch-sizes 1 --steps-only --json-out "$OUT/bench.json" \
        2>&1 | tee "$OUT/bench.log"; then
    log "timing: bench done"
else
    log "timing: cluster.speed.measure FAILED (see bench.log)"
    [ "$status" -eq 0 ] && status=2
fi

log "timing: paired end to end (benchmarks/paired_e2e.py: llama-3.1-8b shape, random weights, bf16, batch $E2E_BATCHES x $CONTEXTS)"
if step "$PY" benchmarks/paired_e2e.py --shape llama-3.1-8b --device cuda --dtype bfloat16 --batch-sizes "$E2E_BATCHES" \
        --context-lengths "$CONTEXTS" --methods sparsespec-l:auto,sparsespec-l:4 --gen-tokens 32 --reps 1 --schedule run --max-batch-tokens 262144 \
        --json-out "$OUT/e2e.json" 2>&1 | tee "$OUT/e2e.log"; then
    log "timing: paired e2e done"
else
    log "timing: paired_e2e FAILED (see e2e.log)"
    [ "$status" -eq 0 ] && status=2
fi

if v="$("$PY" -c "import vllm; print(vllm.__version__)" 2>/dev/null)"; then
    log "vllm: $v importable (vllm:* sweep methods can run on this machine's GPU workers)"
else
    log "vllm: not importable in $PY (vllm:* sweep methods cannot run here)"
fi

log "gpu_check end, status $status"
exit "$status"
