#!/usr/bin/env bash
# session 52's first device call: the GDN prep kernel with its Tm products' operands rounded to
# TF32 where stored (gdnp_prep_tf32, the new default) against rounded at each load
# (gdnp_prep_tf32lx, the form before; the same bits), and the prep's parts left out one at a
# time (ablate bits, timing only). target/gpu-bundle (this tree) and target/gpu-bundle-base
# (HEAD 8064cc8) built with scripts/gpu_bundle.sh; the checkout slimmed with scripts/gpu_slim.sh
# out, results aside.
set -uo pipefail
O=${OUT:-/tmp/out}; R=/tmp/res; mkdir -p $O $R
. scripts/gpu_unpack.sh
b=/tmp/b
gpu_unpack_bins target/gpu-bundle $b || exit 2
gpu_unpack_bins target/gpu-bundle-base $b -base || exit 2
gpu_cuda_env target/gpu-bundle target/gpu-bundle-base
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $R/gpu.txt
pk() { tar -C $R -czf $O/s52.tar.gz .; }
W=/tmp/calla-gpu; mkdir -p $W
( $b/calla synth --out $W/full-q4 --bits 4 > $R/synth-full.txt 2>&1; echo synth-full rc $? >> $R/synth-full.txt ) &
SP=$!
echo "== selftest gdnpre ($(date +%T))"
timeout 300 $b/cuda_selftest --only gdnpre > $R/selftest-gdnpre.txt 2>&1; echo rc $?; pk
grep -E "SELFTEST|FAIL| failed|panicked" $R/selftest-gdnpre.txt | head -8
echo "round at store = at load lines ok: $(grep "rounding at store = at load" $R/selftest-gdnpre.txt | grep -c " ok"), all: $(grep -c "rounding at store = at load" $R/selftest-gdnpre.txt)"
grep -E "tf32-wgc T=|gdn_prefill prep T=" $R/selftest-gdnpre.txt | cut -c1-300
wait $SP; tail -1 $R/synth-full.txt
echo "== prefill compare ($(date +%T))"
timeout 150 $b/calla cuda-bench --model $W/full-q4 --pdl --prompt-tokens 1024,8192 --decode-contexts 128 --gen-tokens 4 --prefill-compare --prefill-compare-only gdn_prep_old_ms --prefill-compare-rounds 9 > $R/compare.txt 2>&1; echo rc $?
grep -E "prefill compare|^prefill +[0-9]+:" $R/compare.txt | cut -c1-220; pk
timeout 40 $b/calla synth --out $W/L4 --layers 4 --bits 4 > /dev/null 2>&1
echo "== cuda-check L4 ($(date +%T))"
timeout 150 $b/calla cuda-check --model $W/L4 --pdl > $R/cuda-check.txt 2>&1; echo rc $?; tail -2 $R/cuda-check.txt
pk
echo "== base selftest gdnpre --quick, timings ($(date +%T))"
timeout 150 $b/cuda_selftest-base --quick --only gdnpre > $R/selftest-gdnpre-base.txt 2>&1; echo rc $?
grep -E "tf32-wgc T=" $R/selftest-gdnpre-base.txt | cut -c1-250
echo "== done ($(date +%T))"
pk
