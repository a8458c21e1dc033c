#!/usr/bin/env bash
# session 54's device script (argument: the phase). Not run in session 54: sixteen starts failed
# and seven more calls were refused, and the failed starts used up the device time. Ready for the
# next session (rebuild the bundle from this commit first), phase A first, then 3 on the same
# warm machine:
# A: self-test gdnpre (the GDN prep's Tm products balanced over the warps: bits against the
#    other form, the prep's forms timed), the whole prefill with each new switch flipped in one
#    process, then while the call's time allows cuda-check on 4 layers (the balanced prep; the
#    attention tile at pos0 > 0), self-test attnpre (session 53's TMA tile after the mbarrier-init
#    fence, its new cases) and cuda-check at pos0 % 16 = 4;
# M: the least (little device time left): self-test gdnpre, then the first cuda-check;
# 3: the benchmark of the defaults.
set -uo pipefail
P=${1:-A}
O=${OUT:-/tmp/out}; R=/tmp/res54-$P; mkdir -p $O $R
. scripts/gpu_unpack.sh
b=/tmp/b54
[ -x $b/calla ] || gpu_unpack_bins target/gpu-bundle $b || exit 2
gpu_cuda_env target/gpu-bundle
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $R/gpu.txt
pk() { tar -C $R -czf $O/s54-$P.tar.gz .; }
W=/tmp/calla-gpu; mkdir -p $W
full() { [ -d $W/full-q4 ] || timeout 200 $b/calla synth --out $W/full-q4 --bits 4 > $R/synth.txt 2>&1; }
l4() { [ -d $W/L4 ] || timeout 60 $b/calla synth --out $W/L4 --layers 4 --bits 4 > /dev/null 2>&1; }
selftest_gdnpre() {
  echo "== selftest gdnpre ($(date +%T))"
  timeout 150 $b/cuda_selftest --quick --only gdnpre > $R/selftest-gdnpre.txt 2>&1; echo rc $?; pk
  grep -E "SELFTEST|FAIL| failed|panicked" $R/selftest-gdnpre.txt | head -8
  local k="products balanced = one row tile per warp, bit for bit"
  echo "balanced = one row tile per warp: $(grep "$k" $R/selftest-gdnpre.txt | grep -c " ok") ok of $(grep -c "$k" $R/selftest-gdnpre.txt)"
  grep -E "gdn_prefill prep|gdn_prefill tf32wgc" $R/selftest-gdnpre.txt | cut -c1-230
}
selftest_attnpre() {
  echo "== selftest attnpre ($(date +%T))"
  timeout 120 $b/cuda_selftest --quick --only attnpre > $R/selftest-attnpre.txt 2>&1; echo rc $?; pk
  grep -E "SELFTEST|FAIL| failed|panicked" $R/selftest-attnpre.txt | head -8
  for f in Wg128ws Wg128tma Wg128mc; do echo "$f bit-for-bit ok: $(grep " $f out = Wg128's, bit for bit" $R/selftest-attnpre.txt | grep -c " ok") of $(grep -c " $f out = Wg128's, bit for bit" $R/selftest-attnpre.txt)"; done
}
# check NAME SECONDS FLAGS...: cuda-check on the 4-layer model
check() {
  local name=$1 secs=$2; shift 2
  echo "== cuda-check $name ($(date +%T))"
  timeout $secs $b/calla cuda-check --model $W/L4 --pdl "$@" > $R/cuda-check-$name.txt 2>&1; echo rc $?; pk
  grep -E "CUDA CHECK|FAIL|mismatch" $R/cuda-check-$name.txt | head -3
}
if [ $P = A ]; then
  full & selftest_gdnpre; wait; tail -1 $R/synth.txt 2>/dev/null
  echo "== prefill compare ($(date +%T))"
  timeout 200 $b/calla cuda-bench --model $W/full-q4 --pdl --prompt-tokens 1024,8192 --decode-contexts 128 --gen-tokens 4 --prefill-compare --prefill-compare-only gdn_prep_balanced_ms,dense_big_long_ms --prefill-compare-rounds 7 > $R/compare.txt 2>&1; echo rc $?; pk
  grep -E "prefill compare" $R/compare.txt | cut -c1-300
  l4
  # 4,100 tokens in chunks of 2,048: the attention tile at pos0 2,048; chunks of 2,052 put one
  # at pos0 % 16 = 4
  [ $SECONDS -lt 380 ] && check 4100 100 --gdn-prep-balanced --prompt-tokens 300,4100 --prefill-chunk 2048
  [ $SECONDS -lt 440 ] && selftest_attnpre
  [ $SECONDS -lt 520 ] && check 4100-c2052 70 --prompt-tokens 4100 --prefill-chunk 2052
fi
if [ $P = M ]; then
  selftest_gdnpre; l4
  check 4100 100 --gdn-prep-balanced --prompt-tokens 300,4100 --prefill-chunk 2048
fi
if [ $P = 3 ]; then
  echo "== bench ($(date +%T))"
  full
  timeout 250 $b/calla cuda-bench --model $W/full-q4 --pdl --prompt-tokens 512,1024,2048,8192 --decode-contexts 128,4096,32768 --gen-tokens 64 > $R/bench.txt 2>&1; echo rc $?; pk
  grep -E "^prefill|^decode|calla cuda-bench" $R/bench.txt | cut -c1-200
fi
echo "== done ($(date +%T))"
pk
