#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MOK_COMMIT=$1
python3 -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | tail -2
LB="python3 -m mok_serve.loadtest.layer_bench"
$LB --sweep --sweep-repeats 5 --sweep-labels default "dec B" "dec B k64" --sweep-points GLM-4.5:1 GLM-4.5:2 GLM-4.5:8 Qwen3-235B-A22B:1 Qwen3-235B-A22B:2 DeepSeek-V3:1 DeepSeek-V3:2 DeepSeek-V3:8 Kimi-K2:1 Qwen3-30B-A3B:2 Qwen3-30B-A3B:8 Qwen3-30B-A3B:32 GLM-4.5:1:skewed --out $OUT --name sweep_swap4_$1 2>&1 | grep "MEDIAN\|NOT BIT\|failed" | cut -c1-200
