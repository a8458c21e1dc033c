#!/usr/bin/env bash
# Runs on the GPU machine: MLX-LM's CUDA backend (PyPI mlx, mlx-cuda-13, mlx-lm) on an MLX-layout
# folder, with bench/mlx_bench.py. The wheels come carried in .whl/ (scripts/gpu_wheels.sh
# fetches them on the development machine). A wheel too large for one call travels in parts
# (NAME.whl.part-aa, -ab, ...) with NAME.whl.sha256; each call copies the parts it brought to
# /tmp/calla-wheel-parts, and once every part is there (the checksum matches) they are joined.
# Exit status 3: parts still missing (call again with the next part while the machine is warm).
#
#   scripts/gpu_mlx.sh MODEL_DIR OUTDIR [PROMPT_TOKENS (default 512,2048,8192)] [GEN_TOKENS (default 64)]
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: scripts/gpu_mlx.sh MODEL_DIR OUTDIR [PROMPT_TOKENS] [GEN_TOKENS]" >&2; exit 2; }
model=$1; out=$2; prompts=${3:-512,2048,8192}; gen=${4:-64}
mkdir -p "$out"
parts=/tmp/calla-wheel-parts
mkdir -p $parts
cp .whl/* $parts/ 2>/dev/null || true
missing=0
for sum in $parts/*.whl.sha256; do
  [ -e "$sum" ] || continue
  whl=$parts/$(basename "$sum" .sha256)
  if [ ! -f "$whl" ]; then
    cat "$whl".part-* > "$whl.tmp" 2>/dev/null
    if (cd $parts && sha256sum --quiet -c <(sed "s|  .*|  $(basename "$whl").tmp|" "$sum")) 2>/dev/null; then
      mv "$whl.tmp" "$whl"; echo "joined $(basename "$whl")"
    else
      rm -f "$whl.tmp"; echo "$(basename "$whl"): parts $(ls "$whl".part-* 2>/dev/null | wc -l) so far, not complete"; missing=1
    fi
  fi
done
[ "$missing" = 0 ] || exit 3
site=/tmp/calla-mlx-site
key=$(sha256sum $parts/*.whl | sha256sum | cut -c1-16)  # reinstall when the wheels change
if [ ! -f "$site/.installed-$key" ]; then
  rm -rf $site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $site $parts/*.whl || exit 1
  touch "$site/.installed-$key"
fi
export PYTHONPATH=$site
# mlx-cuda-13 links against the NVIDIA wheels the image already has (cublas, cudnn, nvrtc, ...)
nv=$(python3 -c "import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))" 2>/dev/null)/nvidia
libs=$(find "$nv" -maxdepth 3 -name lib -type d 2>/dev/null | tr '\n' ':')
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:-}"
python3 bench/mlx_bench.py --model "$model" --prompt-tokens "$prompts" --gen-tokens "$gen" --trials 1 \
  --json "$out/mlx-bench.json" > "$out/mlx-bench.txt" 2> "$out/mlx-bench.log"
rc=$?
tail -5 "$out/mlx-bench.log"
exit $rc
