#!/bin/bash
set -x
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MOK_COMMIT=$1
python3 -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv
LB="python3 -m mok_serve.loadtest.layer_bench"
$LB --profile GLM-4.5:1 GLM-4.5:1:skewed Qwen3-235B-A22B:1 Qwen3-235B-A22B:1:skewed DeepSeek-V3:1 Qwen3-30B-A3B:1 --out $OUT --name profile_decode_$1 2>&1 | grep -v Warning | tail -60
$LB --sweep --sweep-repeats 3 --sweep-points GLM-4.5:1 Qwen3-235B-A22B:1 --out $OUT --name sweep_decode_$1 2>&1 | grep "MEDIAN\|NOT BIT\|failed"
for i in 1 2 3; do
  for mode in clocks noclocks; do
    extra=""; [ $mode = noclocks ] && extra="--no-clocks"
    $LB --sweep --sweep-labels default --sweep-repeats 3 --sweep-points GLM-4.5:1 Qwen3-235B-A22B:2048 Qwen3-30B-A3B:8192 $extra --out $OUT/ab --name ab_${mode}_$i 2>&1 | grep MEDIAN | sed "s/^/$mode $i /"
  done
done
