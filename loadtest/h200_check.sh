#!/usr/bin/env bash
# The kernels' checks at this tree's commit on one H200 (a device call), logs under OUT:
#   bash loadtest/h200_check.sh tests OUT                 # pytest -m gpu: bf16, FP8 and timing kernels, then EP
#   bash loadtest/h200_check.sh layer OUT [ARGS...]      # layer benchmark, bf16, against vLLM's fused_experts
#   bash loadtest/h200_check.sh layer-fp8 OUT [ARGS...]  # the same with block-FP8 experts
#   bash loadtest/h200_check.sh sweep OUT [ARGS...]      # the bf16 kernels' variants against the default
#   bash loadtest/h200_check.sh sweep-fp8 OUT [ARGS...]  # the FP8 kernels' unmeasured variants against the default
#   bash loadtest/h200_check.sh linear-tests OUT         # pytest -m gpu: the batch-invariant GEMM, attention, RMSNorm, warm-up
#   bash loadtest/h200_check.sh deterministic-serving OUT  # pytest -m gpu: the --deterministic servers' probe (vLLM)
#   bash loadtest/h200_check.sh fp8-cutlass OUT          # MOK_DETERMINISTIC_FP8_GEMM=cutlass: vLLM's CUTLASS GEMM's bits
#   bash loadtest/h200_check.sh linear OUT [ARGS...]     # mok-loadtest linear: it against cuBLAS and vLLM's invariant GEMM
#   bash loadtest/h200_check.sh linear-fp8 OUT [ARGS...] # mok-loadtest linear --fp8: block FP8 against vLLM's GEMMs
#   bash loadtest/h200_check.sh sweep-linear OUT [ARGS...]  # its tile variants at prefill-sized points
#   bash loadtest/h200_check.sh attention OUT [ARGS...]  # mok-loadtest attention: invariant attention against vLLM's
#   bash loadtest/h200_check.sh ncu-linear-fp8 OUT [MODEL:LAYER:ROWS]  # Nsight Compute: the block-FP8 GEMM's tiles and
#                                                      # vLLM's CUTLASS one at a prefill point (default Qwen3 qkv_proj 8192)
#   bash loadtest/h200_check.sh step-profile OUT SHAPE MOE_BACKEND [ARGS...]  # one decode step at c=1 or --batch N (ARGS:
#                                                      # --deterministic, --prefill-prompts P, --input-len N...)
# ARGS go to `mok-loadtest layer` (e.g. --shapes, --tokens). `tests` needs no vLLM (a session's
# first call); the layer steps need vLLM staged from ../shared/gpu-vllm (else no vLLM column).
# Each step runs under its own time limit, so a hung test still leaves the other steps' logs.
# Set MOK_COMMIT where the tree has no .git.
set -uo pipefail
what=${1:-} out=${2:-}
[[ -n $out ]] || { echo "usage: $0 tests|layer|layer-fp8|sweep|sweep-fp8|... OUT [ARGS...]" >&2; exit 2; }
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
    step "gpu_tests_$commit.log" 250 python3 -m pytest -m gpu -q tests/kernels/test_ep_cuda_simulated_gpu.py \
      tests/kernels/test_ep_cuda_gpu.py ;;
  layer)
    step "h200_check_layer_$commit.log" 570 mok-loadtest layer --out "$out" --name "layer_bench_$commit" --no-history "$@" ;;
  layer-fp8)
    step "h200_check_layer_fp8_$commit.log" 570 mok-loadtest layer --fp8 --out "$out" --name "layer_bench_fp8_$commit" \
      --no-history "$@" ;;
  sweep)  # the bf16 kernels' variants against the default (--sweep-points, --sweep-labels: which)
    step "h200_check_sweep_$commit.log" 570 mok-loadtest layer --sweep --sweep-repeats 3 --out "$out" \
      --name "sweep_$commit" --no-history "$@" ;;
  sweep-fp8)  # decode points (split, 32-column and one-launch GEMM1) and prefill ones (64-row, half-tail GEMM2)
    step "h200_check_sweep_fp8_$commit.log" 570 mok-loadtest layer --sweep --fp8 --sweep-repeats 3 --out "$out" \
      --name "sweep_fp8_$commit" --no-history --sweep-points Qwen3-30B-A3B:1 Qwen3-30B-A3B:8 Qwen3-30B-A3B:32 \
      DeepSeek-V3:1 DeepSeek-V3:8 DeepSeek-V3:2048 DeepSeek-V3:8192 Qwen3-30B-A3B:2048 \
      --sweep-labels default "g1 n128" "g1 n32" "one launch" "one launch n32" "g2 m64 s3" "g2 m64 s4" \
      "g2 m64 group32" group32 "g2 half tail" "$@" ;;
  linear-tests)
    step "invariant_gpu_tests_$commit.log" 500 python3 -m pytest -m gpu -q tests/kernels/test_invariant_linear_gpu.py \
      tests/kernels/test_invariant_linear_fp8_gpu.py \
      tests/kernels/test_invariant_attention_gpu.py tests/kernels/test_invariant_rms_norm_gpu.py \
      tests/kernels/test_invariant_warm_up_gpu.py ;;
  deterministic-serving)  # servers' logs and probes in one archive (a call brings back a bounded number of files)
    MOK_TEST_LOG_DIR=$out/deterministic_serving step "deterministic_serving_gpu_tests_$commit.log" 570 \
      python3 -m pytest -m gpu -q tests/server/test_deterministic_serving_gpu.py
    cp "$out/deterministic_serving/summary.md" "$out/deterministic_serving_summary_$commit.md"
    tar czf "$out/deterministic_serving_$commit.tgz" -C "$out" deterministic_serving && rm -rf "$out/deterministic_serving" ;;
  fp8-cutlass)  # vLLM's CUTLASS block-FP8 GEMM as --deterministic may call it: its GPU tests, then its bits beside kittens'
    step "fp8_cutlass_gpu_tests_$commit.log" 300 python3 -m pytest -m gpu -q tests/vllm_glue/test_deterministic_cutlass_gpu.py
    step "fp8_cutlass_bits_$commit.log" 300 python3 -m mok_serve.loadtest.fp8_cutlass_bits \
      --out "$out/fp8_cutlass_bits_$commit.json" ;;
  linear)
    step "h200_check_linear_$commit.log" 570 mok-loadtest linear --out "$out" --no-history "$@" ;;
  linear-fp8)  # block-FP8 dense layers: kittens against vLLM's CUTLASS and Triton GEMMs, each one's row-alone bits
    step "h200_check_linear_fp8_$commit.log" 570 mok-loadtest linear --fp8 --out "$out" --no-history "$@" ;;
  sweep-linear)
    step "h200_check_sweep_linear_$commit.log" 570 mok-loadtest linear --sweep --no-history --out "$out" \
      --points Qwen3-30B-A3B:qkv_proj:2048 Qwen3-30B-A3B:o_proj:2048 Qwen3-30B-A3B:o_proj:256 \
      Qwen3-30B-A3B:qkv_proj:8192 GLM-4.5-Air:o_proj:2048 GLM-4.5-Air:lm_head:2048 Qwen3-30B-A3B:o_proj:64 "$@" ;;
  ncu-linear-fp8)  # the first launches of each kernel in a one-repeat sweep (its bit checks run eagerly first:
    # _linear_kernel's default tile, then the 64 x 128 one; device_kernel: vLLM's CUTLASS GEMM), the full section
    # set; the reports come back as .ncu-rep files and as text. KERNELS="REGEX:COUNT ..." picks which.
    point=${1:-Qwen3-30B-A3B:qkv_proj:8192}
    for spec in ${KERNELS:-_linear_kernel:2 device_kernel:1}; do
      kernel=${spec%:*} rep=$out/ncu_linear_fp8_${spec%:*}_$commit
      rep=${rep/_linear_fp8__/_linear_fp8_}
      step "ncu_linear_fp8_$commit.log" 300 ncu --clock-control none --set full --kernel-name "regex:$kernel" \
        --launch-count "${spec#*:}" -f -o "$rep" mok-loadtest linear --fp8 --sweep --sweep-repeats 1 --no-history \
        --out "$out/ncu_sweep" --points "$point" --sweep-labels "fp8 64x128 s4 w4 TMA A"
      [[ -f $rep.ncu-rep ]] && step "ncu_linear_fp8_$commit.log" 60 ncu -i "$rep.ncu-rep" --page details
    done
    rm -rf "$out/ncu_sweep" ;;
  attention)
    step "h200_check_attention_$commit.log" 570 mok-loadtest attention --out "$out" --no-history "$@" ;;
  step-profile)  # SHAPE (mok-serve build-model --list) MOE_BACKEND [ARGS of mok-loadtest step-profile];
    # WEIGHT_GIB as in h200_serving.sh (DeepSeek-V3 FP8 on an 80 GB card: 40)
    source "$(dirname "$0")/device_model.sh"
    device_model "$1"
    step "step_profile_$commit.log" 400 mok-loadtest step-profile "$model" --moe-backend "$2" "${@:3}" \
      --attention-backend TRITON_ATTN --out "$out" ;;
  *) echo "usage: $0 tests|layer|layer-fp8|sweep|sweep-fp8|linear-tests|deterministic-serving|fp8-cutlass|linear|linear-fp8|sweep-linear|attention|ncu-linear-fp8|step-profile OUT [ARGS...]" >&2; exit 2 ;;
esac
