#!/usr/bin/env bash
# session 51's fifth device call: the 128-row flash tile's K/V copies on a fast path (a block whose
# keys are all visible: one source address plus constant steps, no per-copy bound check; the same
# bytes). new = the working tree (target/gpu-bundle-new), base = 34bb95a (target/gpu-bundle), both
# built with scripts/gpu_bundle.sh. Self-test attnpre of both (flash timings; the error figures must
# be equal), whole prefill A/B in alternating processes, cuda-check of new on 2,048-token chunks.
set -uo pipefail
O=${OUT:-/tmp/out}; R=/tmp/res; mkdir -p $O $R
b=/tmp/b; mkdir -p $b
un() { python3 -c "import lzma,sys; sys.stdout.buffer.write(lzma.open(sys.argv[1]).read())" $1 > $2; chmod +x $2; }
un target/gpu-bundle-new/calla.xz $b/calla-new; un target/gpu-bundle-new/cuda_selftest.xz $b/selftest-new
un target/gpu-bundle/calla.xz $b/calla-base; un target/gpu-bundle/cuda_selftest.xz $b/selftest-base
export CALLA_NVRTC_DIR=$(dirname $(find /usr/local /usr/lib /opt -name libnvrtc.so.13 2>/dev/null | head -1))
export CALLA_CUDA_CACHE=/tmp/cc; mkdir -p $CALLA_CUDA_CACHE
for t in target/gpu-bundle-new/cuda-cache.tar.xz target/gpu-bundle/cuda-cache.tar.xz; do python3 -c "import sys,tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" $t $CALLA_CUDA_CACHE; done
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $R/gpu.txt
pk() { tar -C $R -czf $O/s51e.tar.gz .; }
W=/tmp/calla-gpu; mkdir -p $W
( $b/calla-base synth --out $W/full-q4 --bits 4 > $R/synth-full.txt 2>&1; echo synth-full rc $? >> $R/synth-full.txt ) &
SP=$!
for v in new base; do
  echo "== selftest attnpre $v ($(date +%T))"
  timeout 150 $b/selftest-$v --quick --only attnpre > $R/selftest-attnpre-$v.txt 2>&1; echo rc $?; pk
  grep -E "SELFTEST|FAIL| failed|panicked" $R/selftest-attnpre-$v.txt | head -4
  grep -E "pos0    0:|pos0 7680:" $R/selftest-attnpre-$v.txt | sed -E 's/\| (Q64|Q128)[^|]*//g' | cut -c1-200
done
echo "error figures equal (new vs base, out lines): $(diff <(grep ' out ' $R/selftest-attnpre-new.txt | grep -v 'bit for bit') <(grep ' out ' $R/selftest-attnpre-base.txt | grep -v 'bit for bit') > /dev/null && echo yes || echo NO)"
wait $SP; tail -1 $R/synth-full.txt
for round in 1 2; do for v in base new; do
  timeout 60 $b/calla-$v cuda-bench --model $W/full-q4 --pdl --prompt-tokens 1024,2048,8192 --decode-contexts 128 --gen-tokens 4 > $R/ab-$v-$round.txt 2>&1
  echo "$v $round rc $? $(grep -E '^prefill +[0-9]+:' $R/ab-$v-$round.txt | awk '{printf "%s %s ms; ", $2, $4}')"; pk
done; done
timeout 40 $b/calla-new synth --out $W/L4 --layers 4 --bits 4 > /dev/null 2>&1
echo "== cuda-check L4 new, chunks of 2048 ($(date +%T))"
timeout 150 $b/calla-new cuda-check --model $W/L4 --pdl --prompt-tokens 300,2100 --prefill-chunk 2048 > $R/cuda-check-new.txt 2>&1; echo rc $?; tail -1 $R/cuda-check-new.txt
echo "== done ($(date +%T))"
pk
