#!/usr/bin/env bash
# Run the whole GPU suite on a fresh CUDA host, in one go (see /work/shared/gpu/README.md):
#   1. unpack the TileLang bundle (.gpu/tilelang-*.tar.xz) into /tmp/site if tilelang is missing
#   2. precompile every kernel specialisation in parallel (tools/precompile.py)
#   3. pytest: tests/single_card_tests + the CPU host-logic tests, with PyTorch
#   4. a compute-sanitizer memcheck of one small case (H=8, -1 rows), if compute-sanitizer exists
#   5. kernel timings at the reference shape (tools/kernel_timing.py) and the benchmark
#      (tools/bench/, when present)
# Logs go to $OUT (when set) or ./gpu-suite-logs.  Usage:
#   bash tools/run_gpu_suite.sh [--quick]     # --quick: skip memcheck and benchmark
# Exit status: pytest's (the other steps only log).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
LOG=${OUT:-$ROOT/gpu-suite-logs}
mkdir -p "$LOG"
QUICK=0
[[ "${1:-}" == "--quick" ]] && QUICK=1

if ! python3 -c "import tilelang" 2>/dev/null; then
  BUNDLE=$(ls .gpu/tilelang-*.tar.xz 2>/dev/null | head -1)
  if [[ -n "$BUNDLE" ]]; then
    mkdir -p /tmp/site && tar -C /tmp/site -xJf "$BUNDLE"
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
fi
export PYTHONPATH=$ROOT/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-$ROOT/.tilelang-cache}

{
  echo "== versions"
  date -u
  python3 -c "import tilelang, torch; print('tilelang', tilelang.__version__, '| torch', torch.__version__, '| cuda', torch.version.cuda, '|', torch.cuda.get_device_name())"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
} 2>&1 | tee "$LOG/versions.txt"

echo "== precompile"
python3 tools/precompile.py --jobs "$(nproc)" 2>&1 | tee "$LOG/precompile.log"

echo "== pytest"
python3 -m pytest -q -s tests/single_card_tests tests/test_interface.py tests/test_kernel_compile.py \
  2>&1 | tee "$LOG/pytest.log"
RC=${PIPESTATUS[0]}

if [[ $QUICK == 0 ]] && command -v compute-sanitizer >/dev/null; then
  echo "== memcheck"
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 \
    python3 tests/single_card_tests/memcheck_case.py 2>&1 | tail -40 | tee "$LOG/memcheck.log"
  echo "memcheck exit ${PIPESTATUS[0]}" | tee -a "$LOG/memcheck.log"
fi

echo "== kernel timing"
python3 tools/kernel_timing.py --heads 64 2>&1 | tee "$LOG/timing.log"

if [[ $QUICK == 0 && -d tools/bench ]]; then
  echo "== benchmark"
  for f in tools/bench/run.sh tools/bench/bench_sparse_attn.py; do
    if [[ -f $f ]]; then
      case $f in
        *.sh) bash "$f" 2>&1 | tee "$LOG/bench.log" ;;
        *.py) python3 "$f" 2>&1 | tee "$LOG/bench.log" ;;
      esac
      break
    fi
  done
fi
echo "pytest exit status $RC"
exit "$RC"
