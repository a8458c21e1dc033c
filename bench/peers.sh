#!/usr/bin/env bash
# calla vs llama.cpp and MLX-LM on the CPU, on the same synthetic weights. See docs/BENCH.md.
#   bench/peers.sh --layers 4 --bits 4 --prompt-tokens 512 --gen-tokens 64 --workdir /tmp/calla-bench
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec python3 "$here/peers.py" "$@"
