#!/usr/bin/env bash
# Benchmark entry point for tools/run_gpu_suite.sh (which runs it from the repository root).
# Writes into $OUT/bench when $OUT is set (the device machine's returned folder), else into
# tools/bench/results/.  Extra flags: arguments, or $BENCH_ARGS (e.g. "--quick --budget-s 200").
set -uo pipefail
cd "$(dirname "$0")/../.."
DEST=${OUT:+$OUT/bench}
DEST=${DEST:-tools/bench/results}
# standalone use on a fresh host: TileLang from the bundle the GPU suite also uses
if ! python3 -c "import tilelang" 2>/dev/null; then
  BUNDLE=$(ls .gpu/tilelang-*.tar.xz 2>/dev/null | head -1)
  if [[ -n "$BUNDLE" ]]; then
    [[ -d /tmp/site/tilelang ]] || { mkdir -p /tmp/site && tar -C /tmp/site -xJf "$BUNDLE"; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-$PWD/.tilelang-cache}  # where precompile.py puts them
# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
exec python3 tools/bench/bench_sparse_mqa.py --out "$DEST" ${BENCH_ARGS:-} "$@"
