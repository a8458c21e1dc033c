#!/usr/bin/env bash
# session 54's device script, one phase per call on the same warm machine (argument 1, 2 or 3).
# Not run in session 54: no machine started in twelve tries, and the device time went to the
# failed starts. Ready for the next session (rebuild the bundle from this commit first); phase
# A is the one to run first.
# 1: self-tests gdnpre (the GDN prep's Tm products balanced over the warps: bits against the
#    unbalanced twin, the prep's forms timed) and attnpre (session 53's TMA tile after the
#    mbarrier-init fence, its new cases), the full-size synthetic model made beside them;
# 2: cuda-check on 4 layers (the balanced prep; the attention tile at pos0 > 0 and at
#    pos0 % 16 = 4), then the whole prefill with each new switch flipped in one process;
# 3: the benchmark of the defaults;
# A: 1 and 2 in one call (the compare first, each later step only while the call's time allows);
# M: the least (the session's device time nearly spent): self-test gdnpre, then cuda-check on 4
#    layers while time allows.
set -uo pipefail
P=${1:-1}
O=${OUT:-/tmp/out}; R=/tmp/res54-$P; mkdir -p $O $R
. scripts/gpu_unpack.sh
b=/tmp/b54
[ -x $b/calla ] || gpu_unpack_bins target/gpu-bundle $b || exit 2
gpu_cuda_env target/gpu-bundle
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $R/gpu.txt
pk() { tar -C $R -czf $O/s54-$P.tar.gz .; }
W=/tmp/calla-gpu; mkdir -p $W
if [ $P = 1 ]; then
  [ -d $W/full-q4 ] || (timeout 200 $b/calla synth --out $W/full-q4 --bits 4 > $R/synth.txt 2>&1; echo "synth rc $?" >> $R/synth.txt) &
  echo "== selftest gdnpre ($(date +%T))"
  timeout 200 $b/cuda_selftest --quick --only gdnpre > $R/selftest-gdnpre.txt 2>&1; echo rc $?; pk
  grep -E "SELFTEST|FAIL| failed|panicked" $R/selftest-gdnpre.txt | head -8
  echo "balanced = one row tile per warp: $(grep "products balanced = one row tile per warp, bit for bit" $R/selftest-gdnpre.txt | grep -c " ok") ok of $(grep -c "products balanced = one row tile per warp, bit for bit" $R/selftest-gdnpre.txt)"
  grep -E "gdn_prefill prep|gdn_prefill tf32wgc" $R/selftest-gdnpre.txt | cut -c1-230
  echo "== selftest attnpre ($(date +%T))"
  timeout 200 $b/cuda_selftest --quick --only attnpre > $R/selftest-attnpre.txt 2>&1; echo rc $?; pk
  grep -E "SELFTEST|FAIL| failed|panicked" $R/selftest-attnpre.txt | head -8
  for f in Wg128ws Wg128tma Wg128mc; do echo "$f bit-for-bit ok: $(grep " $f out = Wg128's, bit for bit" $R/selftest-attnpre.txt | grep -c " ok") of $(grep -c " $f out = Wg128's, bit for bit" $R/selftest-attnpre.txt)"; done
  wait; cat $R/synth.txt 2>/dev/null | tail -2
fi
if [ $P = 2 ]; then
  [ -d $W/L4 ] || timeout 60 $b/calla synth --out $W/L4 --layers 4 --bits 4 > /dev/null 2>&1
  echo "== cuda-check ($(date +%T))"
  timeout 150 $b/calla cuda-check --model $W/L4 --pdl --gdn-prep-balanced --prompt-tokens 300,4100 --prefill-chunk 2048 > $R/cuda-check-4100.txt 2>&1; echo rc $?
  grep -E "CUDA CHECK|FAIL|mismatch" $R/cuda-check-4100.txt | head -3
  timeout 150 $b/calla cuda-check --model $W/L4 --pdl --prompt-tokens 4100 --prefill-chunk 2052 > $R/cuda-check-4100-c2052.txt 2>&1; echo rc $?
  grep -E "CUDA CHECK|FAIL|mismatch" $R/cuda-check-4100-c2052.txt | head -3
  pk
  echo "== prefill compare ($(date +%T))"
  [ -d $W/full-q4 ] || timeout 200 $b/calla synth --out $W/full-q4 --bits 4 > $R/synth.txt 2>&1
  timeout 300 $b/calla cuda-bench --model $W/full-q4 --pdl --prompt-tokens 1024,2048,8192 --decode-contexts 128 --gen-tokens 4 --prefill-compare --prefill-compare-only gdn_prep_balanced_ms,dense_big_long_ms --prefill-compare-rounds 9 > $R/compare.txt 2>&1; echo rc $?
  grep -E "prefill compare" $R/compare.txt | cut -c1-300
fi
if [ $P = A ]; then
  [ -d $W/full-q4 ] || (timeout 200 $b/calla synth --out $W/full-q4 --bits 4 > $R/synth.txt 2>&1; echo "synth rc $?" >> $R/synth.txt) &
  echo "== selftest gdnpre ($(date +%T))"
  timeout 150 $b/cuda_selftest --quick --only gdnpre > $R/selftest-gdnpre.txt 2>&1; echo rc $?; pk
  grep -E "SELFTEST|FAIL| failed|panicked" $R/selftest-gdnpre.txt | head -8
  echo "balanced = one row tile per warp: $(grep "products balanced = one row tile per warp, bit for bit" $R/selftest-gdnpre.txt | grep -c " ok") ok of $(grep -c "products balanced = one row tile per warp, bit for bit" $R/selftest-gdnpre.txt)"
  grep -E "gdn_prefill prep|gdn_prefill tf32wgc" $R/selftest-gdnpre.txt | cut -c1-230
  wait; tail -1 $R/synth.txt 2>/dev/null
  echo "== prefill compare ($(date +%T))"
  timeout 200 $b/calla cuda-bench --model $W/full-q4 --pdl --prompt-tokens 1024,8192 --decode-contexts 128 --gen-tokens 4 --prefill-compare --prefill-compare-only gdn_prep_balanced_ms,dense_big_long_ms --prefill-compare-rounds 7 > $R/compare.txt 2>&1; echo rc $?; pk
  grep -E "prefill compare" $R/compare.txt | cut -c1-300
  [ -d $W/L4 ] || timeout 60 $b/calla synth --out $W/L4 --layers 4 --bits 4 > /dev/null 2>&1
  if [ $SECONDS -lt 380 ]; then
    echo "== cuda-check ($(date +%T))"
    timeout 100 $b/calla cuda-check --model $W/L4 --pdl --gdn-prep-balanced --prompt-tokens 300,4100 --prefill-chunk 2048 > $R/cuda-check-4100.txt 2>&1; echo rc $?
    grep -E "CUDA CHECK|FAIL|mismatch" $R/cuda-check-4100.txt | head -3; pk
  fi
  if [ $SECONDS -lt 440 ]; then
    echo "== selftest attnpre ($(date +%T))"
    timeout 120 $b/cuda_selftest --quick --only attnpre > $R/selftest-attnpre.txt 2>&1; echo rc $?; pk
    grep -E "SELFTEST|FAIL| failed|panicked" $R/selftest-attnpre.txt | head -8
    for f in Wg128ws Wg128tma Wg128mc; do echo "$f bit-for-bit ok: $(grep " $f out = Wg128's, bit for bit" $R/selftest-attnpre.txt | grep -c " ok") of $(grep -c " $f out = Wg128's, bit for bit" $R/selftest-attnpre.txt)"; done
  fi
  if [ $SECONDS -lt 520 ]; then
    timeout 70 $b/calla cuda-check --model $W/L4 --pdl --prompt-tokens 4100 --prefill-chunk 2052 > $R/cuda-check-4100-c2052.txt 2>&1; echo rc $?
    grep -E "CUDA CHECK|FAIL|mismatch" $R/cuda-check-4100-c2052.txt | head -3
  fi
fi
if [ $P = M ]; then
  echo "== selftest gdnpre ($(date +%T))"
  timeout 150 $b/cuda_selftest --quick --only gdnpre > $R/selftest-gdnpre.txt 2>&1; echo rc $?; pk
  grep -E "SELFTEST|FAIL| failed|panicked" $R/selftest-gdnpre.txt | head -8
  echo "balanced = one row tile per warp: $(grep "products balanced = one row tile per warp, bit for bit" $R/selftest-gdnpre.txt | grep -c " ok") ok of $(grep -c "products balanced = one row tile per warp, bit for bit" $R/selftest-gdnpre.txt)"
  grep -E "gdn_prefill prep|gdn_prefill tf32wgc" $R/selftest-gdnpre.txt | cut -c1-230
  [ -d $W/L4 ] || timeout 60 $b/calla synth --out $W/L4 --layers 4 --bits 4 > /dev/null 2>&1
  echo "== cuda-check ($(date +%T))"
  timeout 100 $b/calla cuda-check --model $W/L4 --pdl --gdn-prep-balanced --prompt-tokens 300,4100 --prefill-chunk 2048 > $R/cuda-check-4100.txt 2>&1; echo rc $?
  grep -E "CUDA CHECK|FAIL|mismatch" $R/cuda-check-4100.txt | head -3
fi
if [ $P = 3 ]; then
  echo "== bench ($(date +%T))"
  [ -d $W/full-q4 ] || timeout 200 $b/calla synth --out $W/full-q4 --bits 4 > $R/synth.txt 2>&1
  timeout 250 $b/calla cuda-bench --model $W/full-q4 --pdl --prompt-tokens 512,1024,2048,8192 --decode-contexts 128,4096,32768 --gen-tokens 64 > $R/bench.txt 2>&1; echo rc $?; pk
  grep -E "^prefill|^decode|calla cuda-bench" $R/bench.txt | cut -c1-200
fi
echo "== done ($(date +%T))"
pk
