#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MOK_COMMIT=$1
python3 -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | tail -2
LB="python3 -m mok_serve.loadtest.layer_bench"
$LB --sweep --sweep-repeats 3 --sweep-labels default "swap" "swap g1 s8" "swap g1 s12" "swap g1 s16" "swap g1 s20" "swap g1 k128 s4" "swap g1 k128 s6" "swap g1 k128 s10" "swap g2 s6" "swap g2 k128 s3" --sweep-points GLM-4.5:1 GLM-4.5:1:skewed Qwen3-235B-A22B:1 Qwen3-235B-A22B:1:skewed DeepSeek-V3:1 --out $OUT --name sweep_swap2_$1 2>&1 | grep "MEDIAN\|NOT BIT\|failed" | cut -c1-200
