#!/usr/bin/env bash
# session 56's device script: session 55's phases A and B and the benchmark in one call (little
# device time left after failed starts; the machine is released 30 s after a call). Run from
# the bundle of commit 942b406 (session 55's kernels, now listed among the entry points).
#   bash target/gpu-bundle/device.sh
# 1. self-test gdnpre,acts (full and 4-layer synthetic models written meanwhile);
# 2. whole-prefill compare of the four opt-in switches at 1k and 8k;
# 3. cuda-check on 4 layers with the balanced prep and the fused norm through global memory,
#    4,100-token prompts in chunks of 2,048 (and 300);
# 4. the benchmark, if the time allows.
set -uo pipefail
O=${OUT:-/tmp/out}; R=/tmp/res56; mkdir -p $O $R
. scripts/gpu_unpack.sh
b=/tmp/b56
[ -x $b/calla ] || gpu_unpack_bins target/gpu-bundle $b || exit 2
gpu_cuda_env target/gpu-bundle
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $R/gpu.txt
pk() { tar -C $R -czf $O/s56.tar.gz .; }
W=/tmp/calla-gpu; mkdir -p $W
( [ -d $W/full-q4 ] || timeout 200 $b/calla synth --out $W/full-q4 --bits 4 > $R/synth.txt 2>&1
  [ -d $W/L4 ] || timeout 60 $b/calla synth --out $W/L4 --layers 4 --bits 4 > /dev/null 2>&1 ) &
echo "== selftest gdnpre,acts ($(date +%T))"
timeout 170 $b/cuda_selftest --quick --only gdnpre,acts > $R/selftest-gdnpre.txt 2>&1; echo rc $?; pk
grep -E "SELFTEST|FAIL| failed|panicked" $R/selftest-gdnpre.txt | head -8
k="products balanced = one row tile per warp, bit for bit"
echo "balanced: $(grep "$k" $R/selftest-gdnpre.txt | grep -c " ok") ok of $(grep -c "$k" $R/selftest-gdnpre.txt)"
k="norm in the state kernel"
echo "fused norm: $(grep "$k" $R/selftest-gdnpre.txt | grep -c " ok") ok of $(grep -c "$k" $R/selftest-gdnpre.txt)"
grep -E "clusters of gdnp_state|tickets" $R/selftest-gdnpre.txt | cut -c1-200 | head -4
grep -E "gdn_prefill prep|gdn_prefill acts|gdn_prefill tf32wgc" $R/selftest-gdnpre.txt | cut -c1-230
wait; tail -1 $R/synth.txt
echo "== prefill compare ($(date +%T))"
timeout 240 $b/calla cuda-bench --model $W/full-q4 --pdl --prompt-tokens 1024,8192 --decode-contexts 128 --gen-tokens 4 --prefill-compare --prefill-compare-only gdn_prep_balanced_ms,dense_big_long_ms,gdn_fused_norm_ms,gdn_fused_norm_global_ms --prefill-compare-rounds 7 > $R/compare.txt 2>&1; echo rc $?; pk
grep -E "prefill compare|warn" $R/compare.txt | cut -c1-300
echo "== cuda-check ($(date +%T))"
timeout 120 $b/calla cuda-check --model $W/L4 --pdl --gdn-prep-balanced --gdn-fused-norm-global --prompt-tokens 300,4100 --prefill-chunk 2048 > $R/cuda-check.txt 2>&1; echo rc $?; pk
grep -E "CUDA CHECK|FAIL|mismatch" $R/cuda-check.txt | head -3
left=$((585 - SECONDS))
if [ $left -gt 120 ]; then
  echo "== bench ($(date +%T), ${left} s)"
  timeout $left $b/calla cuda-bench --model $W/full-q4 --pdl --prompt-tokens 1024,8192 --decode-contexts 128,4096 --gen-tokens 64 > $R/bench.txt 2>&1; echo rc $?; pk
  grep -E "^prefill|^decode" $R/bench.txt | cut -c1-200
fi
echo "== done ($(date +%T))"
