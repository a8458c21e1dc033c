# Sourced on the GPU machine (bash), from the repository root: the unpacking that every device
# script needs for the bundles scripts/gpu_bundle.sh builds (scripts/gpu_run.sh, and the A/B
# scripts of two or more bundles kept in crates/cuda/results).
#
#   . scripts/gpu_unpack.sh
#   gpu_unpack_bins target/gpu-bundle /tmp/b          # /tmp/b/calla, /tmp/b/cuda_selftest
#   gpu_unpack_bins target/gpu-bundle-base /tmp/b -base   # /tmp/b/calla-base, ...
#   gpu_cuda_env target/gpu-bundle target/gpu-bundle-base
#
# gpu_unpack_bins BUNDLE DEST [SUFFIX]: decompresses BUNDLE/calla.xz and BUNDLE/cuda_selftest.xz
# into DEST/calla$SUFFIX and DEST/cuda_selftest$SUFFIX (executable); status 2 naming the missing
# file otherwise.
# gpu_cuda_env BUNDLE...: exports CALLA_NVRTC_DIR (the folder of this machine's libnvrtc.so.13,
# unless already set) and CALLA_CUDA_CACHE (default /tmp/calla-cuda-cache), and extracts each
# BUNDLE/cuda-cache.tar.xz there (the cubins compiled on the build machine; where this machine's
# NVRTC version differs the kernels compile here instead).

gpu_unpack_bins() {
  local bundle=$1 dest=$2 suffix=${3:-} f
  mkdir -p "$dest"
  for f in calla cuda_selftest; do
    python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" "$bundle/$f.xz" > "$dest/$f$suffix" \
      && chmod +x "$dest/$f$suffix" || { echo "missing $bundle/$f.xz (run scripts/gpu_bundle.sh)"; return 2; }
  done
}

gpu_cuda_env() {
  local lib bundle
  if [ -z "${CALLA_NVRTC_DIR:-}" ]; then
    lib=$(find /usr/local /usr/lib /opt -name 'libnvrtc.so.13' 2>/dev/null | head -1)
    [ -n "$lib" ] && export CALLA_NVRTC_DIR=$(dirname "$lib")
  fi
  export CALLA_CUDA_CACHE="${CALLA_CUDA_CACHE:-/tmp/calla-cuda-cache}"
  for bundle in "$@"; do
    if [ -f "$bundle/cuda-cache.tar.xz" ]; then
      mkdir -p "$CALLA_CUDA_CACHE"
      python3 -c "import sys, tarfile; t = tarfile.open(sys.argv[1]); t.extractall(sys.argv[2], **({'filter': 'data'} if hasattr(tarfile, 'data_filter') else {}))" "$bundle/cuda-cache.tar.xz" "$CALLA_CUDA_CACHE"
    fi
  done
}
