#!/usr/bin/env bash
# Builds, on the development machine (no GPU needed), everything the GPU machine runs, into
# target/gpu-bundle/: `calla` with the `cuda` feature and the kernel self-test `cuda_selftest`,
# both stripped, and the kernel cache (`calla cuda-compile`, cuda-cache.tar.xz). Carry that
# folder to the GPU machine and run scripts/gpu_run.sh there.
#
#   scripts/gpu_bundle.sh            # then, on the GPU machine: scripts/gpu_run.sh OUTDIR
set -euo pipefail
cd "$(dirname "$0")/.."
target="${CARGO_TARGET_DIR:-target}"
# Every kernel must compile with NVRTC before anything is carried (scripts/test.sh installs
# NVRTC into target/nvrtc).
nvrtc_lib="$PWD/target/nvrtc/nvidia/cu13/lib"
if [ -d "$nvrtc_lib" ]; then
  LD_LIBRARY_PATH="$nvrtc_lib:${LD_LIBRARY_PATH:-}" cargo test --release -p cuda --test compile
else
  echo "note: $nvrtc_lib missing (run scripts/test.sh once); kernels not compile-checked here" >&2
fi
# no built-in demo model: the bundle must stay small enough to carry
cargo build --release -p calla --no-default-features --features cuda
cargo build --release -p cuda --bin cuda_selftest
rm -rf target/gpu-bundle; mkdir -p target/gpu-bundle
# stripped and xz-compressed: the device carries the whole checkout plus this folder in 64 MiB
# (scripts/gpu_run.sh unpacks them)
for b in calla cuda_selftest; do
  strip -o "target/gpu-bundle/$b" "$target/release/$b"
  xz -9e -f "target/gpu-bundle/$b"
done
# the kernel cache, filled here (NVRTC, no GPU): a bare GPU machine with the same NVRTC version
# then loads the cubins instead of compiling every kernel file (~2.5 minutes of device time);
# scripts/gpu_run.sh unpacks it into $CALLA_CUDA_CACHE
if [ -d "$nvrtc_lib" ]; then
  rm -rf target/gpu-cache
  LD_LIBRARY_PATH="$nvrtc_lib:${LD_LIBRARY_PATH:-}" "$target/release/calla" cuda-compile --cache target/gpu-cache >/dev/null
  tar -C target/gpu-cache -cf - . | xz -6 -T0 > target/gpu-bundle/cuda-cache.tar.xz
fi
git rev-parse HEAD > target/gpu-bundle/COMMIT 2>/dev/null || true
[ -z "$(git status --porcelain 2>/dev/null)" ] || echo dirty >> target/gpu-bundle/COMMIT
ls -la target/gpu-bundle
