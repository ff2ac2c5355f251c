#!/bin/bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MOK_COMMIT=$1
python3 -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | tail -2
python3 -m pytest -m gpu tests/test_triton_moe_gpu.py -o addopts="" -q -rA 2>&1 | grep -v "^$" > $OUT/gpu_tests_$1.log; tail -3 $OUT/gpu_tests_$1.log
CUDA_VISIBLE_DEVICES=0 python3 -m pytest -m gpu tests/test_ep_cuda_simulated_gpu.py -o addopts="" -q -rA 2>&1 > $OUT/ep_sim_gpu_tests_$1.log; tail -3 $OUT/ep_sim_gpu_tests_$1.log
LB="python3 -m mok_serve.loadtest.layer_bench"
$LB --sweep --sweep-repeats 3 --sweep-points Qwen3-30B-A3B:1 GLM-4.5:1 Qwen3-235B-A22B:1 DeepSeek-V3:1 Qwen3-30B-A3B:8 --out $OUT --name sweep_decode_$1 2>&1 | grep "MEDIAN\|NOT BIT\|failed" | cut -c1-200
$LB --out $OUT 2>&1 | tail -3
