#!/bin/bash
# Two revisions of cgist side by side in one run: a benchmark of each revision (bench/loss_stage.py, or $BENCH) on
# its own installed copy, alternating A, B, A, B, ... so that both see the same machine state.
#
#   bash bench/compare_revisions.sh REV_A REV_B [ROUNDS] -- [the benchmark's arguments]
#   bash bench/compare_revisions.sh bd8cebc HEAD 2 -- --device cpu --sizes 1024,4096 --dims 384 --negatives 1 \
#       --providers cgist-torch,gemm
#   BENCH=bench/maxsim_stage.py bash bench/compare_revisions.sh 9fc77be HEAD 2 -- --sizes 512 \
#       --providers cgist-cached,cgist-plain,gemm --threads 2 --memory-share 100
#
# Each revision is checked out in a temporary worktree and installed there with pip --no-deps --target (the venv
# stays as it is); the tables of every run are printed with their revision and round, and kept under $OUT
# (default: a temporary folder).
set -euo pipefail
rev_a=$1 rev_b=$2 rounds=${3:-2} bench=${BENCH:-bench/loss_stage.py}
shift 3 || shift $#
[ "${1:-}" = "--" ] && shift
root=$(git rev-parse --show-toplevel)
work=$(mktemp -d)
out=${OUT:-$work/runs}
mkdir -p "$out"
trap 'for r in a b; do git -C "$root" worktree remove --force "$work/$r" 2>/dev/null || true; done' EXIT
for r in a b; do
  rev=$([ $r = a ] && echo "$rev_a" || echo "$rev_b")
  git -C "$root" worktree add -q --detach "$work/$r" "$rev"
  pip install -q --no-deps --no-build-isolation --target "$work/$r-site" "$work/$r"
done
for round in $(seq 1 "$rounds"); do
  for r in a b; do
    rev=$([ $r = a ] && echo "$rev_a" || echo "$rev_b")
    (cd "$work/$r" && PYTHONPATH="$work/$r-site" python "$bench" "$@" --out "$out/$r-$round" > "$out/$r-$round.log" 2>&1)
    echo "== $rev (round $round)"
    grep '^| ' "$out/$r-$round"/*.md
  done
done
