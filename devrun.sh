#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MOK_COMMIT=$1
python3 -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | tail -2
LB="python3 -m mok_serve.loadtest.layer_bench"
$LB --sweep --sweep-repeats 3 --sweep-labels default "swap" "swap g1" "swap g2" "swap s6/5" "swap s8/5" "swap s10/6" "swap s8/4" "swap g2 n/2" "swap s8/5 g1 n*2" --sweep-points GLM-4.5:1 Qwen3-235B-A22B:1 DeepSeek-V3:1 GLM-4.5:1:skewed Qwen3-235B-A22B:2 Qwen3-30B-A3B:2 --out $OUT --name sweep_swap_$1 2>&1 | grep "MEDIAN\|NOT BIT\|failed" 
python3 -m pytest -m gpu tests/test_triton_moe_gpu.py -o addopts="" -q -x 2>&1 | tail -3
