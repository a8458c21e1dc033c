#!/usr/bin/env bash
# session 53's third device script: the warp-specialized 128-row flash tile in three forms
# against Wg128 (Wg128ws: cp.async from the producer warpgroup; Wg128tma: bulk tensor copies
# from one producer thread; Wg128mc: those multicast over clusters of two blocks, each key
# block crossing from L2 once per two tiles): self-test `attnpre` (each against the CPU and
# against Wg128 bit for bit; every tile's flash timings), cuda-check with tma and mc, the whole
# prefill with each form in one process against Wg128, and ncu of tma and mc at 8k.
set -uo pipefail
O=${OUT:-/tmp/out}; R=/tmp/res3; mkdir -p $O $R
. scripts/gpu_unpack.sh
b=/tmp/b3
gpu_unpack_bins target/gpu-bundle $b || exit 2
gpu_cuda_env target/gpu-bundle
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $R/gpu.txt
pk() { tar -C $R -czf $O/s53c.tar.gz .; }
W=/tmp/calla-gpu; mkdir -p $W
echo "== selftest attnpre ($(date +%T))"
timeout 170 $b/cuda_selftest --quick --only attnpre > $R/selftest-attnpre.txt 2>&1; echo rc $?; pk
grep -E "SELFTEST|FAIL| failed|panicked" $R/selftest-attnpre.txt | head -8
for f in Wg128ws Wg128tma Wg128mc; do echo "$f bit-for-bit ok: $(grep " $f out = Wg128's, bit for bit" $R/selftest-attnpre.txt | grep -c " ok$\| ok ") of $(grep -c " $f out = Wg128's, bit for bit" $R/selftest-attnpre.txt)"; done
grep -E " (FAIL|fail)" $R/selftest-attnpre.txt | head -5 | cut -c1-220
grep -E "pos0    0:|pos0 7680:|pos0 8128:" $R/selftest-attnpre.txt | sed -E 's/\| (Q64|Q128|Wg64 split [0-9]+)[^|]*//g' | cut -c1-330
echo "== synth ($(date +%T))"
[ -d $W/L4 ] || timeout 60 $b/calla synth --out $W/L4 --layers 4 --bits 4 > /dev/null 2>&1
[ -d $W/full-q4 ] || timeout 150 $b/calla synth --out $W/full-q4 --bits 4 > $R/synth.txt 2>&1; echo rc $?
for f in tma mc; do
  echo "== cuda-check $f ($(date +%T))"
  timeout 60 $b/calla cuda-check --model $W/L4 --pdl --attn-ws true --attn-ws-form $f --prompt-tokens 300,2100 --prefill-chunk 2048 > $R/cuda-check-$f.txt 2>&1; echo rc $?
  grep -E "CUDA CHECK|FAIL|mismatch" $R/cuda-check-$f.txt | head -3
done
pk
for f in ws tma mc; do
  echo "== prefill compare $f ($(date +%T))"
  timeout 100 $b/calla cuda-bench --model $W/full-q4 --pdl --attn-ws-form $f --prompt-tokens 2048,8192 --decode-contexts 128 --gen-tokens 4 --prefill-compare --prefill-compare-only attn_wg128ws_ms --prefill-compare-rounds 9 > $R/compare-$f.txt 2>&1; echo rc $?
  grep -E "prefill compare" $R/compare-$f.txt 2>/dev/null | cut -c1-220
done
pk
NCU=$(ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
for f in tma mc; do
  echo "== ncu $f 8k ($(date +%T))"
  timeout 80 $NCU -k regex:"^attn_prefill_flash_wg128${f}_acts\$" -c 1 --metrics gpu__time_duration.sum,lts__t_bytes.sum.per_second,lts__t_bytes.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__warps_eligible.avg.per_cycle_active,sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio $b/calla cuda-bench --model $W/L4 --pdl --attn-ws true --attn-ws-form $f --prompt-tokens 8192 --decode-contexts 128 --gen-tokens 1 > $R/ncu-$f-8k.txt 2>&1; echo rc $?
  grep -E "attn_prefill_flash|duration|gmma|issue_active|eligible|lts__t_bytes|stalled_(barrier|wait|long|math|dispatch|selected|not_sel|short)" $R/ncu-$f-8k.txt | head -16
done
echo "== done ($(date +%T))"
pk
