#!/usr/bin/env bash
# The test command (README, .ci/run): installs what the tests need on a fresh machine, then runs
# every test of the workspace. Needs root for apt-get on a machine without Chromium.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
cargo --version
# Server tests (crates/calla/tests/serve.rs): headless Chromium for the dashboard test and the
# official openai Python client, pinned, in a venv.
command -v chromium >/dev/null || { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium; }
[ -x .venv-server/bin/python ] || python3 -m venv .venv-server
.venv-server/bin/python -c 'import openai, sys; sys.exit(openai.__version__ != "1.109.1")' 2>/dev/null \
  || .venv-server/bin/pip install -q openai==1.109.1
# CUDA kernels (crates/cuda/tests/compile.rs compiles every kernel for sm_90a with NVRTC; no GPU
# and no driver needed): NVRTC 13.0 from PyPI into target/nvrtc, where the crate looks for it.
[ -f target/nvrtc/nvidia/cu13/lib/libnvrtc.so.13 ] \
  || .venv-server/bin/pip install -q --target target/nvrtc nvidia-cuda-nvrtc==13.0.88
export LD_LIBRARY_PATH="$PWD/target/nvrtc/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
cargo test --workspace --release "$@"
# The CUDA commands of `calla` (cargo feature `cuda`) must keep building; running them needs a GPU
# (scripts/gpu_run.sh on the GPU machine, docs/CUDA.md).
cargo build --release -p calla --features cuda
