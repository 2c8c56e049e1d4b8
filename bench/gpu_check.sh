#!/usr/bin/env bash
# The GPU check, in one call (under 8 minutes on one H100/H200; no network needed):
#   1. the tests that run on CUDA (kernels in bf16/fp16/tf32/fp32/fp64, determinism);
#   2. the GEMM ceiling (torch.mm bf16 8192^3) and the device copy bandwidth;
#   3. fused Triton fwd+bwd against the streaming path and sentence-transformers' loss stage
#      (where feasible) at B = 4k, 16k, 64k, timed with triton.testing.do_bench (median);
#   4. peak memory of each (torch.cuda.max_memory_allocated);
#   5. the CSV and a short table into OUTDIR; the table is printed last.
#
#   bash bench/gpu_check.sh [OUTDIR]        (default: gpu_check_out)
set -uo pipefail

cd "$(dirname "$0")/.."
OUT="${1:-gpu_check_out}"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET

python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check.sh needs a CUDA GPU')" || exit 2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$OUT/device.txt" || true

status=0
echo "== 1. CUDA tests"
# (first calls compile and autotune every kernel variant: most of this step is compilation)
timeout 240 python -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_determinism.py \
    2>&1 | tee "$OUT/tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "CUDA tests FAILED (see $OUT/tests.txt)"; status=1; }

echo "== 2-5. ceiling, bandwidth, fused vs streaming vs sentence-transformers, peak memory"
timeout 210 python bench/kernel_bench.py --suite check --batch 4096 16384 65536 --dtype bf16 --out "$OUT" \
    2>&1 | tee "$OUT/bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "benchmark FAILED (see $OUT/bench.log)"; status=1; }

echo
echo "== summary ($OUT/gpu_check.csv); tests: $(tail -n 1 "$OUT/tests.txt")"
cat "$OUT/gpu_check.txt" 2>/dev/null || echo "(no table: the benchmark did not finish)"
exit "$status"
