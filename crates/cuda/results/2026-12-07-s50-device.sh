#!/usr/bin/env bash
# session 50's one device call (an H100): the GDN conv folded into the prep kernel (gdnp_prep_tf32c,
# opt-in --gdn-conv-in-prep true; ...-s50-gdn-conv-in-prep.patch, applied on top of session 49's
# wgmma descriptor patch ...-s49-wgmma-desc-add.patch) and the descriptor patch itself.
# new = 68f272a + both patches (target/gpu-bundle), base = 68f272a (target/gpu-bundle-s49b), both
# built here with scripts/gpu_bundle.sh; carry both folders (scripts/gpu_slim.sh out, results aside).
# Self-test gdnpre (new), the fold's --prefill-compare case alone, cuda-check with the conv folded,
# one A/B of the whole prefill (base, new), self-test attnpre (new, base). The base gdnpre self-test
# ran in a second, short call on the warm machine: selftest-base --quick --only gdnpre.
set -uo pipefail
O=${OUT:-/tmp/out}; R=/tmp/res; mkdir -p $O $R
b=/tmp/b; mkdir -p $b
un() { python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" $1 > $2; chmod +x $2; }
un target/gpu-bundle/calla.xz $b/calla-new; un target/gpu-bundle/cuda_selftest.xz $b/selftest-new
un target/gpu-bundle-s49b/calla.xz $b/calla-base; un target/gpu-bundle-s49b/cuda_selftest.xz $b/selftest-base
export CALLA_NVRTC_DIR=$(dirname $(find /usr/local /usr/lib /opt -name libnvrtc.so.13 2>/dev/null | head -1))
export CALLA_CUDA_CACHE=/tmp/cc; mkdir -p $CALLA_CUDA_CACHE
for t in target/gpu-bundle/cuda-cache.tar.xz target/gpu-bundle-s49b/cuda-cache.tar.xz; do python3 -c "import sys,tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" $t $CALLA_CUDA_CACHE; done
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $R/gpu.txt
pk() { tar -C $R -czf $O/s50a.tar.gz .; }
W=/tmp/calla-gpu; mkdir -p $W
( $b/calla-base synth --out $W/full-q4 --bits 4 > $R/synth-full.txt 2>&1; echo synth-full rc $? >> $R/synth-full.txt ) &
SP=$!
v=new; echo "== selftest gdnpre $v ($(date +%T))"
timeout 130 $b/selftest-$v --quick --only gdnpre > $R/selftest-gdnpre-$v.txt 2>&1; echo rc $?; pk
grep -E "SELFTEST|FAIL| failed|panicked" $R/selftest-gdnpre-$v.txt | head -8
echo "conv-in-prep bit-for-bit lines ok: $(grep "bit for bit" $R/selftest-gdnpre-$v.txt | grep -c "conv-in-prep.* ok "), failing: $(grep "bit for bit" $R/selftest-gdnpre-$v.txt | grep "conv-in-prep" | grep -c FAIL)"
grep -E "^gdn_prefill tf32-wgc(\+conv-in-prep(-paired)?)? +T=(1024|8192) " $R/selftest-gdnpre-$v.txt | cut -c1-220
wait $SP; tail -1 $R/synth-full.txt
echo "== fold compare ($(date +%T))"
timeout 70 $b/calla-new cuda-bench --model $W/full-q4 --pdl --prompt-tokens 1024,8192 --decode-contexts 128 --gen-tokens 4 --prefill-compare --prefill-compare-only gdn_conv_in_prep_ms --prefill-compare-rounds 11 > $R/fold-compare.txt 2>&1; echo rc $?
grep "prefill compare" $R/fold-compare.txt | cut -c1-200; pk
timeout 40 $b/calla-new synth --out $W/L4 --layers 4 --bits 4 > /dev/null 2>&1
echo "== cuda-check L4 new, conv in prep ($(date +%T))"
timeout 50 $b/calla-new cuda-check --model $W/L4 --pdl --gdn-conv-in-prep true > $R/cuda-check-new-fold.txt 2>&1; echo rc $?; tail -1 $R/cuda-check-new-fold.txt
pk
for v in base new; do
  n=$(ls $R/ab-$v-*.txt 2>/dev/null | wc -l)
  timeout 40 $b/calla-$v cuda-bench --model $W/full-q4 --pdl --prompt-tokens 1024,8192 --decode-contexts 128 --gen-tokens 4 > $R/ab-$v-$n.txt 2>&1
  echo "$v $n rc $? $(grep -E '^prefill +[0-9]+:' $R/ab-$v-$n.txt | awk '{printf "%s %s ms; ", $2, $4}')"; pk
done
for v in new base; do
  echo "== selftest attnpre $v ($(date +%T))"
  timeout 60 $b/selftest-$v --quick --only attnpre > $R/selftest-attnpre-$v.txt 2>&1; echo rc $?; pk
  grep -E "SELFTEST|FAIL| failed|panicked" $R/selftest-attnpre-$v.txt | head -4
  grep -E "t  1024 pos0    0:|t  8192 pos0    0:" $R/selftest-attnpre-$v.txt | sed -E 's/\| (Q64|Q128)[^|]*//g' | cut -c1-230
done
echo "== done ($(date +%T))"
pk
