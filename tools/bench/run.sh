#!/usr/bin/env bash
# Benchmark entry point for tools/run_gpu_suite.sh (which runs it from the repository root).
# Writes into $OUT/bench when $OUT is set (the device machine's returned folder), else into
# tools/bench/results/.  Extra flags: arguments, or $BENCH_ARGS (e.g. "--quick --budget-s 200").
set -uo pipefail
cd "$(dirname "$0")/../.."
DEST=${OUT:+$OUT/bench}
DEST=${DEST:-tools/bench/results}
# TileLang (bundle), src/ and the kernel cache of tools/precompile.py, as the GPU suite
# shellcheck source=../gpu_env.sh
source tools/gpu_env.sh
# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
exec python3 tools/bench/bench_sparse_mqa.py --out "$DEST" ${BENCH_ARGS:-} "$@"
