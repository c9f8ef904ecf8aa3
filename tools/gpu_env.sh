# Sourced (not run) from the repository root by tools/run_gpu_suite.sh and tools/bench/run.sh:
# the environment of the GPU tools on a fresh CUDA host.
#   * TileLang from a bundle in .gpu/ (tilelang-*.tar.xz) when `import tilelang` fails or when
#     TILELANG_BUNDLE names one: by default the newest version there, unpacked once into
#     /tmp/site; TILELANG_BUNDLE=.gpu/tilelang-0.1.13-cp312.tar.xz (say) unpacks that one into
#     /tmp/site-<its name> instead, so that two versions never mix (e.g. to measure the 0.1.13
#     codegen Paddle users get: build it with ../shared/gpu/make-bundle.sh 0.1.13 ...);
#   * src/ on PYTHONPATH, unbuffered Python output;
#   * TILELANG_CACHE_DIR defaulting to ./.tilelang-cache (where tools/precompile.py puts the
#     compiled kernels, so later steps reuse them; use a separate one per TileLang version).
if [[ -n "${TILELANG_BUNDLE:-}" ]]; then
  _site=/tmp/site-$(basename "$TILELANG_BUNDLE" .tar.xz)
  [[ -d $_site/tilelang ]] || { mkdir -p "$_site" && tar -C "$_site" -xJf "$TILELANG_BUNDLE"; }
  export PYTHONPATH=$_site${PYTHONPATH:+:$PYTHONPATH}
  unset _site
elif ! python3 -c "import tilelang" 2>/dev/null; then
  _bundle=$(ls .gpu/tilelang-*.tar.xz 2>/dev/null | sort -V | tail -1)
  if [[ -n "$_bundle" ]]; then
    [[ -d /tmp/site/tilelang ]] || { mkdir -p /tmp/site && tar -C /tmp/site -xJf "$_bundle"; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  unset _bundle
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-$PWD/.tilelang-cache}
