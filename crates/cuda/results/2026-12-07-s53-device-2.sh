#!/usr/bin/env bash
# session 53's second device script: the warp-specialized 128-row flash attention tile
# (`Wg128ws`: a producer warpgroup, two consumer warpgroups taking turns on the tensor cores,
# setmaxnreg 24/240) against Wg128: self-test `attnpre` (against the CPU, and against Wg128 bit
# for bit; the flash timings of every tile), `cuda-check` with it on, and the whole prefill
# with it in one process. Bundle: target/gpu-bundle (this tree).
set -uo pipefail
O=${OUT:-/tmp/out}; R=/tmp/res2; mkdir -p $O $R
. scripts/gpu_unpack.sh
b=/tmp/b2
gpu_unpack_bins target/gpu-bundle $b || exit 2
gpu_cuda_env target/gpu-bundle
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $R/gpu.txt
pk() { tar -C $R -czf $O/s53b.tar.gz .; }
W=/tmp/calla-gpu; mkdir -p $W
echo "== selftest attnpre ($(date +%T))"
timeout 150 $b/cuda_selftest --quick --only attnpre > $R/selftest-attnpre.txt 2>&1; echo rc $?; pk
grep -E "SELFTEST|FAIL| failed|panicked" $R/selftest-attnpre.txt | head -8
echo "Wg128ws bit-for-bit lines ok: $(grep "Wg128's, bit for bit" $R/selftest-attnpre.txt | grep -c " ok"), all: $(grep -c "Wg128's, bit for bit" $R/selftest-attnpre.txt)"
grep -E "wg128(ws)?(_acts)?:" $R/selftest-attnpre.txt | head -4
grep -E "pos0    0:|pos0 7680:|pos0 8128:" $R/selftest-attnpre.txt | sed -E 's/\| (Q64|Q128)[^|]*//g' | cut -c1-300
echo "== synth ($(date +%T))"
[ -d $W/L4 ] || timeout 60 $b/calla synth --out $W/L4 --layers 4 --bits 4 > /dev/null 2>&1
[ -d $W/full-q4 ] || timeout 150 $b/calla synth --out $W/full-q4 --bits 4 > $R/synth.txt 2>&1; echo rc $?
echo "== cuda-check ($(date +%T))"
timeout 90 $b/calla cuda-check --model $W/L4 --pdl --attn-ws true --prompt-tokens 300,2100 --prefill-chunk 2048 > $R/cuda-check-ws.txt 2>&1; echo rc $?; pk
grep -E "CUDA CHECK|FAIL|mismatch" $R/cuda-check-ws.txt | head -5
echo "== prefill compare ($(date +%T))"
timeout 150 $b/calla cuda-bench --model $W/full-q4 --pdl --prompt-tokens 1024,2048,8192 --decode-contexts 128 --gen-tokens 4 --prefill-compare --prefill-compare-only attn_wg128ws_ms --prefill-compare-rounds 9 > $R/compare-ws.txt 2>&1; echo rc $?; pk
grep -E "prefill compare|TTFT" $R/compare-ws.txt 2>/dev/null | cut -c1-220
NCU=$(ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
echo "== ncu: Wg128ws at 8k ($(date +%T))"
timeout 100 $NCU -k regex:'^attn_prefill_flash_wg128ws_acts$' -c 1 --metrics gpu__time_duration.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__warps_eligible.avg.per_cycle_active,lts__t_bytes.sum.per_second,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio $b/calla cuda-bench --model $W/L4 --pdl --attn-ws true --prompt-tokens 8192 --decode-contexts 128 --gen-tokens 1 > $R/ncu-ws-8k.txt 2>&1; echo rc $?
grep -E "attn_prefill_flash|duration|gmma|issue_active|eligible|lts__t_bytes|stalled_(barrier|wait|long|math|dispatch|selected|not_sel|mio|short|sleeping|membar|branch)" $R/ncu-ws-8k.txt | head -30
echo "== done ($(date +%T))"
pk
