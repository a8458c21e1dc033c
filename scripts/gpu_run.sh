#!/usr/bin/env bash
# Runs on the GPU machine (an H100/H200 with the CUDA 13 driver and NVRTC), from the repository
# root, with target/gpu-bundle/ built by scripts/gpu_bundle.sh:
#   1. the kernel self-test (every kernel against the CPU reference at the real shapes),
#   2. a 4-layer full-width synthetic 4-bit checkpoint, and `calla cuda-check` on it (the GPU
#      decode path against the CPU path, end to end),
#      (also with each other MoE path: `--moe three|fold|cluster|fused`, with the measured
#      variants `--gdn-in-step` and `--gemv-staged`, with `--prefill-router f32`, and with
#      `--prefill-norm-acts-apart` and `--gemm-grouped2`),
#      and `calla serve --device cuda` over HTTP (scripts/gpu_serve_check.py),
#   3. unless --no-bench: the full-size synthetic 4-bit checkpoint and `calla cuda-bench`, then
#      the engine on the GPU (`calla generate --device cuda`, `calla serve --device cuda`)
#      (with --ablate: also each decode kernel class's share of the step; with --ablate or
#      --compare: the decode step variants in one process),
#   4. with --mlx: MLX-LM's CUDA backend on the same full-size folder (bench/mlx_bench.py), from
#      wheels carried in .whl/ (scripts/gpu_wheels.sh; a wheel over the carry limit arrives in
#      parts over several calls and is joined here once all its parts are in).
# With --only-mlx, step 4 alone (on the full-size folder a previous call left). Logs and JSON go
# to OUTDIR (default: ./gpu-out). Exit status: non-zero if any step failed (3: MLX wheel parts
# still missing).
#
# With --timeline, step 3 also lays out the decode step as a kernel timeline (cuda-bench
# --timeline, kernels compiled with the probe) in OUTDIR/timeline.txt; with --timeline-only, that
# alone (no plain cuda-bench). $CALLA_BENCH_FLAGS (e.g. --carveout-before-gemv) go to every
# cuda-bench run.
#
# With --no-cuda-bench, step 3 skips `calla cuda-bench` (the engine steps still run).
#
# With --pack=FILE, OUTDIR is also packed into the gzip tarball FILE at the end (after every
# step, failed or not): OUTDIR holds 10-30 files, more than some ways of fetching results back
# return (the device tool here returns at most 8 files from $OUT: pass --pack=$OUT/gpu-out.tar.gz
# and a work folder as OUTDIR).
#
#   scripts/gpu_run.sh [OUTDIR] [--no-bench] [--no-cuda-bench] [--quick] [--only=SECTIONS] [--ablate | --compare] [--timeline | --timeline-only] [--mlx | --only-mlx] [--no-check] [--pack=FILE]
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  --*|"") out=gpu-out ;;
  *) out=$1; shift ;;
esac
bench=1; quick=""; ablate=""; mlx=0; check=1; timeline=0; cudabench=1; pack=""
for a in "$@"; do
  case "$a" in
    --no-bench) bench=0 ;;
    --quick) quick="$quick --quick" ;;
    --only=*) quick="$quick --only ${a#--only=}" ;;
    --ablate) ablate="--ablate --compare" ;;
    --compare) [ -n "$ablate" ] || ablate="--compare" ;;  # --ablate already includes it
    --mlx) mlx=1 ;;
    --only-mlx) mlx=1; bench=0; check=0 ;;
    --no-check) check=0 ;;
    --no-cuda-bench) cudabench=0 ;;
    --timeline) timeline=1 ;;
    --timeline-only) timeline=2 ;;
    --pack=?*) pack=${a#--pack=} ;;
    *) echo "unknown option $a" >&2; exit 2 ;;
  esac
done
[ "$bench" = 0 ] && [ "$timeline" != 0 ] && echo "note: --timeline runs with the benchmark step; --no-bench / --only-mlx skip it" >&2
mkdir -p "$out"
b=/tmp/calla-gpu-bin
. scripts/gpu_unpack.sh
if [ "$check" = 1 ] || [ "$bench" = 1 ]; then
  gpu_unpack_bins target/gpu-bundle $b || exit 2
fi
gpu_cuda_env target/gpu-bundle
work="${CALLA_GPU_WORK:-/tmp/calla-gpu}"
mkdir -p "$work"
status=0
# a hung kernel (e.g. a grid barrier whose blocks are not all resident) must not eat the whole
# device call: every GPU step gets a wall-clock limit
to="timeout ${CALLA_STEP_TIMEOUT:-420}"
step() { echo "== $1 ($(date +%T))"; }

if [ "$check" = 1 ]; then
  step "kernel self-test"
  $to $b/cuda_selftest $quick > "$out/selftest.txt" 2>&1 || status=1
  tail -3 "$out/selftest.txt"

  step "synth 4 layers, 4-bit"
  [ -f "$work/L4-q4/config.json" ] || $b/calla synth --out "$work/L4-q4" --layers 4 --bits 4 2>&1 | tail -1
  step "cuda-check"
  $to $b/calla cuda-check --model "$work/L4-q4" > "$out/cuda-check.txt" 2>&1 || status=1
  tail -3 "$out/cuda-check.txt"
  step "cuda-check with programmatic dependent launch"
  $to $b/calla cuda-check --model "$work/L4-q4" --pdl > "$out/cuda-check-pdl.txt" 2>&1 || status=1
  tail -3 "$out/cuda-check-pdl.txt"
  # the default MoE path (4-bit experts) is the router folded into the output projection and a
  # cluster per expert; the other paths of `--moe` too
  for path in three fold cluster fused; do
    step "cuda-check with PDL, MoE path $path"
    $to $b/calla cuda-check --model "$work/L4-q4" --pdl --moe $path > "$out/cuda-check-moe-$path.txt" 2>&1 || status=1
    tail -3 "$out/cuda-check-moe-$path.txt"
  done
  # the measured-slower variants kept for comparison: the GDN input projection + step as one
  # launch, and the decode GEMVs reading staged copies by bulk copies
  for v in gdn-in-step gemv-staged; do
    step "cuda-check with PDL, --$v"
    $to $b/calla cuda-check --model "$work/L4-q4" --pdl --$v > "$out/cuda-check-$v.txt" 2>&1 || status=1
    tail -3 "$out/cuda-check-$v.txt"
  done
  # the prefill's other MoE router (f32 chains; the default is the integer products since
  # session 22: docs/CUDA.md "Session 21"), for the check's prefiller and the engine's
  step "cuda-check with PDL, --prefill-router f32"
  $to $b/calla cuda-check --model "$work/L4-q4" --pdl --prefill-router f32 > "$out/cuda-check-router-f32.txt" 2>&1 || status=1
  tail -3 "$out/cuda-check-router-f32.txt"
  # the prefill's norms and GEMM conversions apart, and the grouped narrow tile at two blocks
  # per SM (both the same bits as the defaults: docs/CUDA.md, session 26)
  for v in prefill-norm-acts-apart gemm-grouped2; do
    step "cuda-check with PDL, --$v"
    $to $b/calla cuda-check --model "$work/L4-q4" --pdl --$v > "$out/cuda-check-$v.txt" 2>&1 || status=1
    tail -3 "$out/cuda-check-$v.txt"
  done
  # the attention decode kernels' other trigger placements (the same bits)
  for w in split combine; do
    step "cuda-check with PDL, --attn-trigger-flip $w"
    $to $b/calla cuda-check --model "$work/L4-q4" --pdl --attn-trigger-flip $w > "$out/cuda-check-attn-flip-$w.txt" 2>&1 || status=1
    tail -3 "$out/cuda-check-attn-flip-$w.txt"
  done
  step "calla serve --device cuda over HTTP (scripts/gpu_serve_check.py)"
  $to python3 -u scripts/gpu_serve_check.py $b/calla "$work/L4-q4" --long-tokens 128 > "$out/serve-check.txt" 2>&1 || status=1
  cat "$out/serve-check.txt"
fi

if [ "$bench" = 1 ]; then
  step "synth full size, 4-bit"
  [ -f "$work/full-q4/config.json" ] || $b/calla synth --out "$work/full-q4" --bits 4 > "$out/synth-full.txt" 2>&1 || status=1
  tail -1 "$out/synth-full.txt"
  if [ "$timeline" != 2 ] && [ "$cudabench" = 1 ]; then
    step "cuda-bench"
    $to $b/calla cuda-bench --model "$work/full-q4" --pdl ${CALLA_BENCH_FLAGS:-} $ablate --prompt-tokens 512,1024,2048,8192 --json "$out/cuda-bench.json" > "$out/cuda-bench.txt" 2>&1 || status=1
    cat "$out/cuda-bench.txt" | grep -v '^JSON'
  fi
  if [ "$timeline" != 2 ]; then
    # the same model through the engine (what `calla run|serve --device cuda` run): the
    # decode speed a caller sees, token by token back to the host, and over HTTP
    step "calla generate --device cuda (engine on the accelerator)"
    ids=$(python3 -c "import random; random.seed(5); print(','.join(str(random.randrange(1000, 200000)) for _ in range(1024)))")
    $to $b/calla generate --model "$work/full-q4" --device cuda --ids "$ids" --max-tokens 512 --greedy --ignore-eos 2>"$out/engine-generate.txt" >/dev/null || status=1
    tail -1 "$out/engine-generate.txt"
    step "calla serve --device cuda, full size"
    $to python3 -u scripts/gpu_serve_check.py $b/calla "$work/full-q4" --ctx 16384 --long-tokens 512 > "$out/serve-check-full.txt" 2>&1 || status=1
    cat "$out/serve-check-full.txt"
  fi
  if [ "$timeline" != 0 ]; then
    step "cuda-bench --timeline (kernels with the probe)"
    $to $b/calla cuda-bench --model "$work/full-q4" --pdl ${CALLA_BENCH_FLAGS:-} --timeline --timeline-raw "$out/timeline.bin" --prompt-tokens 512 --decode-contexts 128 --json "$out/timeline.json" > "$out/timeline.txt" 2>&1 || status=1
    grep -v '^JSON' "$out/timeline.txt"
    for f in "$out"/timeline.*.bin; do [ -f "$f" ] && xz -T0 -f "$f"; done
  fi
fi

if [ "$mlx" = 1 ]; then
  step "MLX-LM (CUDA) on the same folder"
  scripts/gpu_mlx.sh "$work/full-q4" "$out"
  rc=$?  # 3: wheel parts still missing (call again with the next part while the machine is warm)
  [ "$rc" = 0 ] || status=$rc
fi
if [ -n "$pack" ]; then
  mkdir -p "$(dirname "$pack")"
  tar -C "$out" -czf "$pack" . && echo "packed $out into $pack" || { echo "could not pack $out into $pack"; status=1; }
fi
echo "== done, status $status"
exit $status
