#!/usr/bin/env bash
# The kernels' checks at this tree's commit on one H200 (a device call), logs under OUT:
#   bash loadtest/h200_check.sh tests OUT                 # pytest -m gpu: bf16, FP8 and timing kernels, then EP
#   bash loadtest/h200_check.sh layer OUT [ARGS...]      # layer benchmark, bf16, against vLLM's fused_experts
#   bash loadtest/h200_check.sh layer-fp8 OUT [ARGS...]  # the same with block-FP8 experts
# ARGS go to `mok-loadtest layer` (e.g. --shapes, --tokens). `tests` needs no vLLM (a session's
# first call); the layer steps need vLLM staged from ../shared/gpu-vllm (else no vLLM column).
# Each step runs under its own time limit, so a hung test still leaves the other steps' logs.
# Set MOK_COMMIT where the tree has no .git.
set -uo pipefail
what=${1:-} out=${2:-}
[[ -n $out ]] || { echo "usage: $0 tests|layer|layer-fp8 OUT [ARGS...]" >&2; exit 2; }
shift 2
commit=${MOK_COMMIT:-$(git rev-parse --short HEAD)}
mkdir -p "$out"

step() {  # LOG LIMIT_S COMMAND...: appends the command's output to OUT/LOG, headed by what ran where
  local log=$out/$1 limit=$2 start=$SECONDS
  shift 2
  {
    echo "# $commit, $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(python3 -c \
      'import torch, triton; print(f"torch {torch.__version__}, Triton {triton.__version__}")'), $(date -u +%FT%TZ)"
    echo "# $*"
    timeout "$limit" "$@"
    echo "# exit $? after $((SECONDS - start)) s"
  } >>"$log" 2>&1
}

case $what in
  tests)
    step "gpu_tests_$commit.log" 400 python3 -m pytest -m gpu -q tests/kernels/test_triton_moe_gpu.py \
      tests/kernels/test_triton_moe_fp8_gpu.py tests/server/test_server_timing_gpu.py
    step "gpu_tests_$commit.log" 150 python3 -m pytest -m gpu -q tests/kernels/test_ep_cuda_simulated_gpu.py \
      tests/kernels/test_ep_cuda_gpu.py ;;
  layer)
    step "layer_bench_$commit.log" 570 mok-loadtest layer --out "$out" --name "layer_bench_$commit" --no-history "$@" ;;
  layer-fp8)
    step "layer_bench_fp8_$commit.log" 570 mok-loadtest layer --fp8 --out "$out" --name "layer_bench_fp8_$commit" \
      --no-history "$@" ;;
  *) echo "usage: $0 tests|layer|layer-fp8 OUT [ARGS...]" >&2; exit 2 ;;
esac
