#!/usr/bin/env bash
# session 55's device script (argument: the phase). Not run in session 55 (no device machine
# was lent). It carries session 54's unrun steps too. Rebuild the bundle from this commit
# (scripts/gpu_bundle.sh), copy this file to target/gpu-bundle/device.sh, carry
# target/gpu-bundle, then on one warm machine: A, B, 3.
# A: self-test sections gdnpre and acts (the GDN prep's balanced Tm products against the other
#    form word for word; the gated norm inside the state kernel against gdn_prefill +
#    convert_acts word for word, in both exchange forms; the prep's forms and the layer with
#    and without the fused norm timed), then the whole prefill with each new switch flipped in
#    one process (gdn_prep_balanced_ms, dense_big_long_ms, gdn_fused_norm_ms,
#    gdn_fused_norm_global_ms) at 1k and 8k;
# B: cuda-check on 4 layers with the balanced prep and the fused norm through global memory
#    (4,100-token prompts in chunks of 2,048: also the attention tile at pos0 > 0), self-test
#    attnpre (session 53's TMA tile after the mbarrier-init fence, its new cases), cuda-check
#    at pos0 % 16 = 4;
# M: the least (little device time left): self-test gdnpre,acts, then the first cuda-check;
# 3: the benchmark of the defaults.
set -uo pipefail
P=${1:-A}
O=${OUT:-/tmp/out}; R=/tmp/res55-$P; mkdir -p $O $R
. scripts/gpu_unpack.sh
b=/tmp/b55
[ -x $b/calla ] || gpu_unpack_bins target/gpu-bundle $b || exit 2
gpu_cuda_env target/gpu-bundle
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $R/gpu.txt
pk() { tar -C $R -czf $O/s55-$P.tar.gz .; }
W=/tmp/calla-gpu; mkdir -p $W
full() { [ -d $W/full-q4 ] || timeout 200 $b/calla synth --out $W/full-q4 --bits 4 > $R/synth.txt 2>&1; }
l4() { [ -d $W/L4 ] || timeout 60 $b/calla synth --out $W/L4 --layers 4 --bits 4 > /dev/null 2>&1; }
selftest_gdnpre() {
  echo "== selftest gdnpre,acts ($(date +%T))"
  timeout 170 $b/cuda_selftest --quick --only gdnpre,acts > $R/selftest-gdnpre.txt 2>&1; echo rc $?; pk
  grep -E "SELFTEST|FAIL| failed|panicked" $R/selftest-gdnpre.txt | head -8
  local k="products balanced = one row tile per warp, bit for bit"
  echo "balanced = one row tile per warp: $(grep "$k" $R/selftest-gdnpre.txt | grep -c " ok") ok of $(grep -c "$k" $R/selftest-gdnpre.txt)"
  k="norm in the state kernel"
  echo "fused norm (both forms) = gdn_prefill + convert_acts: $(grep "$k" $R/selftest-gdnpre.txt | grep -c " ok") ok of $(grep -c "$k" $R/selftest-gdnpre.txt)"
  grep -E "$k|clusters of gdnp_state" $R/selftest-gdnpre.txt | cut -c1-200
  grep -E "gdn_prefill prep|gdn_prefill acts|gdn_prefill tf32wgc" $R/selftest-gdnpre.txt | cut -c1-230
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
  timeout 300 $b/calla cuda-bench --model $W/full-q4 --pdl --prompt-tokens 1024,8192 --decode-contexts 128 --gen-tokens 4 --prefill-compare --prefill-compare-only gdn_prep_balanced_ms,dense_big_long_ms,gdn_fused_norm_ms,gdn_fused_norm_global_ms --prefill-compare-rounds 7 > $R/compare.txt 2>&1; echo rc $?; pk
  grep -E "prefill compare" $R/compare.txt | cut -c1-300
fi
if [ $P = B ]; then
  l4
  # 4,100 tokens in chunks of 2,048: the attention tile at pos0 2,048; chunks of 2,052 put one
  # at pos0 % 16 = 4
  check 4100 120 --gdn-prep-balanced --gdn-fused-norm-global --prompt-tokens 300,4100 --prefill-chunk 2048
  [ $SECONDS -lt 400 ] && selftest_attnpre
  [ $SECONDS -lt 500 ] && check 4100-c2052 80 --prompt-tokens 4100 --prefill-chunk 2052
fi
if [ $P = M ]; then
  selftest_gdnpre; l4
  check 4100 120 --gdn-prep-balanced --gdn-fused-norm-global --prompt-tokens 300,4100 --prefill-chunk 2048
fi
if [ $P = 3 ]; then
  echo "== bench ($(date +%T))"
  full
  timeout 250 $b/calla cuda-bench --model $W/full-q4 --pdl --prompt-tokens 512,1024,2048,8192 --decode-contexts 128,4096,32768 --gen-tokens 64 > $R/bench.txt 2>&1; echo rc $?; pk
  grep -E "^prefill|^decode|calla cuda-bench" $R/bench.txt | cut -c1-200
fi
echo "== done ($(date +%T))"
