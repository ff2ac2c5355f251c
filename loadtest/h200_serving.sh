#!/usr/bin/env bash
# Kittens vs stock (vLLM's own MoE choice) on one H200 with a real-shape model and dummy weights:
# the decode-heavy and prefill-heavy grid of the GPU load-test issue, one server start per backend.
# Usage (on the device, vLLM from ../shared/gpu-vllm): bash loadtest/h200_serving.sh SHAPE OUT_DIR [RATE]
set -euo pipefail
shape=$1 out=$2 rate=${3:-24}
model=/tmp/models/$shape
mok-serve build-model --shape "$shape" --out "$model"
[[ $shape == deepseek* ]] && export VLLM_MLA_DISABLE=1  # the kit has no FlashAttention/FlashInfer for MLA
mok-loadtest serve --model "$model" --backends stock,kittens \
  --server-args="--load-format dummy --attention-backend TRITON_ATTN --max-model-len 8192" \
  --workload "512:256:c=1,8,32,128,256:rate=$rate" --workload 4096:64:c=1,32 \
  --num-requests 8 --requests-per-stream 2 --max-duration 60 --no-progress --out "$out"
