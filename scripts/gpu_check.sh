#!/usr/bin/env bash
# One GPU validation pass, sized for under 10 minutes on one H200 (not yet timed on one; the limits
# below add up to 19.5 minutes): one summary line per check
# (PASS | FAIL | SKIP, the check's name, its figures) and a non-zero exit on any FAIL.
#
#   bash scripts/gpu_check.sh             run every check on the CUDA device
#   bash scripts/gpu_check.sh --dry-run   list each check and the exact command it would run (no GPU needed)
#
# PYTHON picks the interpreter (default: python); GPU_CHECK_OUT the output directory (default:
# runs/gpu_check/<time>), which keeps each check's full log next to the summary.
set -u
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
OUT=${GPU_CHECK_OUT:-runs/gpu_check/$(date +%Y%m%d-%H%M%S)}

# name | time limit (s) | command. Kernel tests first: before (c) may install fla, which would change
# which KDA kernel the model test takes.
CHECKS=(
  "triton_kernels_cuda|240|env -u TRITON_INTERPRET KERNEL_TEST_DEVICE=cuda $PYTHON -m pytest -q -p no:cacheprovider tests/kernels"
  "kernel_report|180|env -u TRITON_INTERPRET $PYTHON -m scripts.kernel_report --archs 90 --dtypes bf16 --measure"
  "bench_kernels|150|$PYTHON -m scripts.bench_kernels --dtype bf16 --tokens 8192 --reps 10 --dims 2304 4096 --sources 8 --queries 6 --summary"
  "fla_chunk_kda|120|{ $PYTHON -m pip install -q --no-deps fla-core flash-linear-attention einops || echo 'SKIP fla_chunk_kda pip install flash-linear-attention failed'; } && $PYTHON -m scripts.gpu_checks.fla_kda"
  "grouped_mm|60|$PYTHON -m scripts.gpu_checks.grouped_mm"
  "train_bf16_m|180|$PYTHON -m scripts.gpu_checks.train_steps --out $OUT/train --steps 30"
  "compiled_decode|240|$PYTHON -m scripts.bench_inference --model s --device cuda --prompt 512 --decode 32 --rounds 3 --compile --summary"
)

if [[ "${1:-}" == "--dry-run" ]]; then
  echo "gpu_check: ${#CHECKS[@]} checks, logs under $OUT (dry run: nothing runs)"
  for check in "${CHECKS[@]}"; do
    IFS='|' read -r name limit command <<<"$check"
    echo "$name (limit ${limit}s): $command"
  done
  exit 0
fi
if [[ $# -gt 0 ]]; then
  echo "gpu_check: unknown argument '$1'; the only option is --dry-run" >&2
  exit 2
fi
if ! $PYTHON -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: no CUDA device visible to $PYTHON (torch.cuda.is_available() is False); run --dry-run to list the checks" >&2
  exit 2
fi

mkdir -p "$OUT"
failures=0
summaries=()
start=$SECONDS
for check in "${CHECKS[@]}"; do
  IFS='|' read -r name limit command <<<"$check"
  log="$OUT/$name.log"
  began=$SECONDS
  timeout "$limit" bash -c "$command" >"$log" 2>&1
  rc=$?
  # A check's own summary line wins (the last PASS/FAIL/SKIP line naming it); otherwise the exit status decides.
  line=$(grep -E "^(PASS|FAIL|SKIP) $name( |$)" "$log" | tail -n 1)
  if [[ $rc -eq 124 ]]; then
    line="FAIL $name timed out after ${limit}s"
  elif [[ -z "$line" ]]; then
    status=PASS; [[ $rc -ne 0 ]] && status=FAIL
    line="$status $name exit=$rc $(grep -v '^\s*$' "$log" | tail -n 1)"
  elif [[ $rc -ne 0 && "$line" != FAIL* && "$line" != SKIP* ]]; then
    line="FAIL $name exit=$rc after: $line"
  fi
  line="$line [$((SECONDS - began))s, $log]"
  [[ "$line" == FAIL* ]] && failures=$((failures + 1))
  summaries+=("$line")
  echo "$line"
done
{ printf '%s\n' "${summaries[@]}"; echo "total $((SECONDS - start))s, $failures failed"; } >"$OUT/summary.txt"
echo "gpu_check: $failures of ${#CHECKS[@]} checks failed in $((SECONDS - start))s; summary in $OUT/summary.txt"
[[ $failures -eq 0 ]]
