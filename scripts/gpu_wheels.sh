#!/usr/bin/env bash
# On the development machine: fetches the wheels of MLX-LM's CUDA backend for the GPU machine
# (Python 3.12, x86-64; it reaches no package registry) into .whl/ (ignored by git), and splits
# any wheel over PART_MB (default 40) into parts with a checksum, because one device call carries
# at most 64 MiB with the working tree. scripts/gpu_mlx.sh joins them there. The packages mlx-lm
# needs beyond these (numpy, transformers, jinja2, pyyaml, protobuf, sentencepiece) and the CUDA
# libraries mlx-cuda-13 links (cublas, cudnn, nvrtc, ...) are already in the GPU machine's image.
#
#   scripts/gpu_wheels.sh [PART_MB]
set -euo pipefail
cd "$(dirname "$0")/.."
part_mb=${1:-40}
ex=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$ex")"; grep -qx '/.whl/' "$ex" 2>/dev/null || echo '/.whl/' >> "$ex"
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  -d .whl mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2
for w in .whl/*.whl; do
  if [ "$(stat -c %s "$w")" -gt $((part_mb * 1024 * 1024)) ]; then
    (cd .whl && sha256sum "$(basename "$w")" > "$(basename "$w").sha256" && split -b "${part_mb}M" "$(basename "$w")" "$(basename "$w").part-" && rm "$(basename "$w")")
  fi
done
ls -la .whl
