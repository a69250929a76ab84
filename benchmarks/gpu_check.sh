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
# Everything lands in $OUT: env.txt, nvidia-smi.txt, pytest.log, pytest.xml, kernels.{log,json},
# bench.{log,json}, e2e.{log,json}, summary.txt. Exit status: 1 if correctness failed (or no GPU/env),
# 2 if only a timing step failed, 0 otherwise.
set -euo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu_out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"

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
if "$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider --junitxml="$OUT/pytest.xml" 2>&1 | tee "$OUT/pytest.log"; then
    log "correctness: PASS ($(tail -1 "$OUT/pytest.log"))"
else
    log "correctness: FAIL ($(tail -1 "$OUT/pytest.log"))"
    status=1
fi
if grep -q "skipped" "$OUT/pytest.log" && ! grep -q "passed" "$OUT/pytest.log"; then
    log "correctness: everything skipped: FAIL"
    status=1
fi

# ---------------------------------------------------------------- timing
log "timing: attention kernels per layer (benchmarks/kernel_timing.py)"
if "$PY" benchmarks/kernel_timing.py --shape llama-3.1-8b --dtype bfloat16 --context-lengths 16384,32768,65536 \
        --json-out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"; then
    log "timing: kernels done"
else
    log "timing: kernel_timing FAILED"
    [ "$status" -eq 0 ] && status=2
fi

log "timing: python -m cluster.speed (llama-3.1-8b shape, random weights, bf16, 16K-64K, batch 1, steps only)"
if "$PY" -m cluster.speed --shape llama-3.1-8b --random-weights --device cuda --dtype bfloat16 \
        --context-lengths 16384,32768,65536 --batch-sizes 1 --steps-only --json-out "$OUT/bench.json" \
        2>&1 | tee "$OUT/bench.log"; then
    log "timing: bench done"
else
    log "timing: cluster.speed.measure FAILED (see bench.log)"
    [ "$status" -eq 0 ] && status=2
fi

log "timing: paired end to end (benchmarks/paired_e2e.py: llama-3.1-8b shape, random weights, bf16, batch 1-16 x 16K-64K)"
if "$PY" benchmarks/paired_e2e.py --shape llama-3.1-8b --device cuda --dtype bfloat16 --batch-sizes 1,4,16 \
        --context-lengths 16384,32768,65536 --methods sparsespec-l:auto,sparsespec-l:4 --gen-tokens 32 --reps 1 --schedule run --max-batch-tokens 262144 \
        --json-out "$OUT/e2e.json" 2>&1 | tee "$OUT/e2e.log"; then
    log "timing: paired e2e done"
else
    log "timing: paired_e2e FAILED (see e2e.log)"
    [ "$status" -eq 0 ] && status=2
fi

log "gpu_check end, status $status"
exit "$status"
