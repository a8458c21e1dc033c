#!/usr/bin/env bash
# session 52's second device call: ncu on the prefill's dense wide-tile GEMM (the GDN in_proj,
# 12,352 x 2,048 at 8,192 tokens, qgemm_q4_wide_lb) and on the grouped expert GEMMs at 8,192
# tokens (gate/up then down, qgemm_q4_tall_ln), on a 4-layer model: are they bound by L2 (the
# wide tile re-reads every activation row once per 128-row tile), the tensor pipe or issue?
# Bundle: target/gpu-bundle (this session's tree).
set -uo pipefail
O=${OUT:-/tmp/out}; R=/tmp/res; mkdir -p $O $R
. scripts/gpu_unpack.sh
b=/tmp/b
[ -x $b/calla ] || gpu_unpack_bins target/gpu-bundle $b || exit 2
gpu_cuda_env target/gpu-bundle
NCU=$(ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1); echo "ncu: $NCU"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $R/gpu.txt
pk() { tar -C $R -czf $O/s52b.tar.gz .; }
W=/tmp/calla-gpu; mkdir -p $W
[ -d $W/L4 ] || timeout 60 $b/calla synth --out $W/L4 --layers 4 --bits 4 > /dev/null 2>&1
S="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats --section Occupancy --section InstructionStats"
echo "== ncu dense wide in_proj 8k ($(date +%T))"
timeout 200 $NCU -k regex:'^qgemm_q4_wide_lb$' -c 1 $S $b/calla cuda-bench --model $W/L4 --pdl --prompt-tokens 8192 --decode-contexts 128 --gen-tokens 1 > $R/ncu-wide-inproj-8k.txt 2>&1; echo rc $?; pk
grep -E "qgemm_q4_wide_lb \(|Duration|Throughput|Pipe|Issue Slots|Eligible|L2 Hit|Warp Cycles Per Issued|Registers Per|Achieved Occ" $R/ncu-wide-inproj-8k.txt | head -40
echo "== ncu grouped gate/up and down 8k ($(date +%T))"
timeout 200 $NCU -k regex:'^qgemm_q4_tall_ln$' -c 2 $S $b/calla cuda-bench --model $W/L4 --pdl --prompt-tokens 8192 --decode-contexts 128 --gen-tokens 1 > $R/ncu-grouped-8k.txt 2>&1; echo rc $?; pk
grep -E "qgemm_q4_tall_ln \(|Duration|Throughput|Pipe|Issue Slots|Eligible|L2 Hit|Warp Cycles Per Issued|Achieved Occ" $R/ncu-grouped-8k.txt | head -40
echo "== done ($(date +%T))"
pk
