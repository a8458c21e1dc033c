#!/usr/bin/env bash
# session 52's fourth device call (found no machine; for the next session): the dense GEMMs' mid tile (128 weight rows x 128 tokens, two
# blocks per SM: four warps per scheduler where the wide tile has two) against the wide tile:
# self-test `wide` (mid = big bit for bit, the dense products' timings with the wide and the mid
# tile), then the whole prefill with it in one process. Bundle: target/gpu-bundle (this tree).
set -uo pipefail
O=${OUT:-/tmp/out}; R=/tmp/res; mkdir -p $O $R
. scripts/gpu_unpack.sh
b=/tmp/b4
gpu_unpack_bins target/gpu-bundle $b || exit 2
gpu_cuda_env target/gpu-bundle
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $R/gpu.txt
pk() { tar -C $R -czf $O/s52e.tar.gz .; }
W=/tmp/calla-gpu; mkdir -p $W
# (a fresh machine: the whole-prefill compare only if the model is there already; the device
# time left this session covers the self-test)
echo "== selftest wide ($(date +%T))"
timeout 170 $b/cuda_selftest --quick --only wide > $R/selftest-wide.txt 2>&1; echo rc $?; pk
grep -E "SELFTEST|FAIL| failed|panicked" $R/selftest-wide.txt | head -8
echo "mid = big lines ok: $(grep "mid tile = big tile" $R/selftest-wide.txt | grep -c " ok"), all: $(grep -c "mid tile = big tile" $R/selftest-wide.txt)"
grep -E "mid tile +[0-9]" $R/selftest-wide.txt | cut -c1-230
[ -d $W/full-q4 ] && echo "== prefill compare ($(date +%T))"
[ -d $W/full-q4 ] && timeout 200 $b/calla cuda-bench --model $W/full-q4 --pdl --prompt-tokens 1024,2048,8192 --decode-contexts 128 --gen-tokens 4 --prefill-compare --prefill-compare-only dense_mid_ms --prefill-compare-rounds 7 > $R/compare-mid.txt 2>&1; echo rc $?
grep -E "prefill compare" $R/compare-mid.txt 2>/dev/null | cut -c1-220
# the GDN prep's stalls at 8,192 tokens: the kernel's launches of the warm-up prompts come
# first (16 tokens, grid (16, 1, 1)), so profile enough of them and keep the 8k grid's
NCU=$(ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
M="--metrics gpu__time_duration.sum,launch__grid_size,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
[ -d $W/L4 ] || timeout 60 $b/calla synth --out $W/L4 --layers 4 --bits 4 > /dev/null 2>&1
echo "== ncu stalls: GDN prep at 8k ($(date +%T))"
timeout 200 $NCU -k regex:'^gdnp_prep_tf32$' -c 30 $M $b/calla cuda-bench --model $W/L4 --pdl --prompt-tokens 8192 --decode-contexts 128 --gen-tokens 1 > $R/ncu-stalls-prep-8k.txt 2>&1; echo rc $?
grep -A40 "gdnp_prep_tf32 (16, 128, 1)" $R/ncu-stalls-prep-8k.txt | head -40
echo "== done ($(date +%T))"
pk
