# Sourced (not run) from the repository root by tools/run_gpu_suite.sh and tools/bench/run.sh:
# the environment of the GPU tools on a fresh CUDA host.
#   * TileLang from the bundle in .gpu/ (tilelang-*.tar.xz, unpacked once into /tmp/site) when
#     `import tilelang` fails;
#   * src/ on PYTHONPATH, unbuffered Python output;
#   * TILELANG_CACHE_DIR defaulting to ./.tilelang-cache (where tools/precompile.py puts the
#     compiled kernels, so later steps reuse them).
if ! python3 -c "import tilelang" 2>/dev/null; then
  _bundle=$(ls .gpu/tilelang-*.tar.xz 2>/dev/null | head -1)
  if [[ -n "$_bundle" ]]; then
    [[ -d /tmp/site/tilelang ]] || { mkdir -p /tmp/site && tar -C /tmp/site -xJf "$_bundle"; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  unset _bundle
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-$PWD/.tilelang-cache}
