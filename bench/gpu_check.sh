#!/usr/bin/env bash
# The GPU check, in one call (under 8 minutes on one H100/H200; no network needed). Every measured figure is
# printed beside the estimate it should confirm (bench/kernel_bench.py's docstring says how they are counted).
#   0. cgist doctor: the device, "auto"'s route and tiles, the first-use check of every score's kernels;
#   1. the tests that run on CUDA (kernels in bf16/fp16/tf32/fp32, mixed pairs, backward chunks, statistics,
#      Matryoshka, determinism; the tf32x3 GEMM of the backward on the tensor cores against its error bound,
#      tests/test_kernels_precision.py; the MaxSim kernels against the PyTorch MaxSim stage and the oracle,
#      tests/test_kernels_maxsim.py), while other processes compile and tune every kernel the benchmark runs;
#   2. calibrations: the GEMM ceiling (torch.mm 8192^3, bf16 and tf32), the device copy bandwidth, the L2
#      bandwidth (a resident buffer of 24 MiB read 64 times);
#   3. torch.unique ids against fingerprint ids (same partition, time, peak memory);
#   4. per kernel and per block (forward, score gradients, GEMMs: for fp32 the tf32x3 GEMM kernel), the autotuner's
#      pick, the loss stage and its peak memory, at B = 64k and 16k for bf16/bf16, fp32/fp32 (tf32x3) and bf16/fp32,
#      and at 4k beside the streaming path and sentence-transformers' loss stage; five Matryoshka dimensions
#      (768/512/256/128/64, bf16, GEMM backward) at 64k and 16k, and their ratio to one dimension;
#   5. the CSV and a table into OUTDIR; the summary (the targets) is printed last.
#
#   bash bench/gpu_check.sh [OUTDIR]                  (default: gpu_check_out)
#   bash bench/gpu_check.sh OUTDIR --simulate ARCH    anywhere: the same steps with CPU tensors standing in for that
#       GPU (CGIST_SIMULATE_DEVICE, docs/devices.md#simulated-devices), the kernels under the Triton interpreter, at a
#       tiny size; the tests are collected, not run (the suite runs them so). Every figure it writes is the CPU's,
#       and its files say so.
set -uo pipefail

cd "$(dirname "$0")/.."
OUT="${1:-gpu_check_out}"
SIMULATE=""
if [ "${2:-}" = "--simulate" ]; then
    SIMULATE="${3:?--simulate needs an architecture, e.g. sm_90}"
fi
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRITON_DEFAULT_FP_FUSION=1

if [ -z "$SIMULATE" ]; then
    unset TRITON_INTERPRET CGIST_SIMULATE_DEVICE
    python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check.sh needs a CUDA GPU')" || exit 2
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$OUT/device.txt" || true
    tests=(-p no:cacheprovider -o "addopts=-m 'not slow'")  # without the coverage measurement of pyproject.toml
    sizes=()
    warm_sizes=()
else
    export CGIST_SIMULATE_DEVICE="$SIMULATE" TRITON_INTERPRET=1
    echo "SIMULATED: $SIMULATE on the CPU (CGIST_SIMULATE_DEVICE), kernels under the Triton interpreter; no figure" \
         "here is a GPU's" | tee "$OUT/device.txt"
    tests=(-p no:cacheprovider -o "addopts=-m 'not slow'" --collect-only)
    sizes=(--batch 24 --dtype fp32 --dim 16 --guide-dim 8 --mm-size 32 --copy-mib 1 --l2-kib 64 --l2-reps 2)
    warm_sizes=(--batch 24 --dim 16 --guide-dim 8)
fi
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"

status=0
echo "== 0. cgist doctor"
python -m cgist doctor 2>&1 | tee "$OUT/doctor.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "cgist doctor FAILED (see $OUT/doctor.txt)"; status=1; }

echo "== 1. CUDA tests (and, beside them, compiling what the benchmark runs)"
warm_pids=()
for pair in bf16 fp32 bf16+fp32; do
    timeout 240 python bench/kernel_bench.py --suite warmup --dtype "$pair" "${warm_sizes[@]}" \
        > "$OUT/warmup_$pair.log" 2>&1 &
    warm_pids+=($!)
done
timeout 240 python -m pytest -q "${tests[@]}" tests/test_kernels.py tests/test_kernels_stats.py \
    tests/test_kernels_matryoshka.py tests/test_kernels_precision.py tests/test_determinism.py \
    tests/test_kernels_maxsim.py \
    2>&1 | tee "$OUT/tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "CUDA tests FAILED (see $OUT/tests.txt)"; status=1; }
for pid in "${warm_pids[@]}"; do
    wait "$pid" || { echo "a warm-up process failed (see $OUT/warmup_*.log)"; status=1; }
done

echo "== 2-5. calibrations, tie ids, kernels per block, loss stage, peak memory"
timeout 200 python bench/kernel_bench.py --suite check --budget-s 150 --out "$OUT" "${sizes[@]}" 2>&1 | tee "$OUT/bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "benchmark FAILED (see $OUT/bench.log)"; status=1; }

echo
echo "== summary ($OUT/gpu_check.csv); tests: $(tail -n 1 "$OUT/tests.txt")"
cat "$OUT/gpu_check.txt" 2>/dev/null || echo "(no table: the benchmark did not finish)"
exit "$status"
