#!/usr/bin/env bash
# Kittens vs stock (vLLM's own MoE choice) on one H200 with a real-shape model and dummy weights:
# the decode-heavy and prefill-heavy grid of the GPU load-test issue, with vLLM's defaults (CUDA
# graphs, torch.compile, chunked prefill):
#   bash loadtest/h200_serving.sh SHAPE BACKEND[,BACKEND] OUT [RATE]   # BACKEND: stock or kittens,
#                                                             # either with -deterministic (mok-serve --deterministic),
#                                                             # or kittens-deterministic-cutlass (block-FP8 dense layers
#                                                             # on vLLM's CUTLASS GEMM: MOK_DETERMINISTIC_FP8_GEMM=cutlass)
# Two backends share one GPU: both servers start at once (a start is ~2.5 min, mostly compiles on
# the host), each with a fixed KV cache (KV_GIB, default 24 GiB: skips vLLM's memory profiling,
# which would count the other server's allocations as its own) and GPU_UTIL (default 0.45) of the
# GPU; then the grid runs against one server, then the other, so no measurement overlaps another.
# RATE (req/s, default 24) is meant to sit just below saturation: about 0.9 x the output tok/s of
# the c=128 run / 256 tokens (Qwen3-30B-A3B bf16: 18; the 6-layer DeepSeek-V3 shape bf16: 12).
# Above it requests pile up and the run measures the backlog (the report's requests in flight).
#   mok-loadtest merge OUT/stock OUT/kittens --out OUT        # after both: one report (and the history.csv rows)
# Results go to OUT/BACKEND (results.json, report.md, plots, server.log). With BENCH=1, vLLM's own
# `vllm bench serve` then measures the 512/256 concurrency-32 point on the same server
# (OUT/BACKEND/vllm_bench.json) for the cross-check. WORKLOADS="512:256:c=1,64 ..." replaces the
# grid (e.g. a short check). PORT (default 8321; the second server PORT+1) lets servers on different
# GPUs of one machine run side by side (CUDA_VISIBLE_DEVICES picks each one's GPU). Set MOK_COMMIT
# where the tree has no .git. WEIGHT_GIB (build-model's --weight-gib, default its own 80) picks how many
# layers a deep shape keeps (DeepSeek-V3 FP8: 40 keeps 3 dense + 3 MoE layers, 30 keeps 3 + 2;
# `mok-serve build-model --list` gives the sizes). SERVE_ARGS (split on spaces) go to every server's
# command line, e.g. SERVE_ARGS='--compilation-config {"max_cudagraph_capture_size":1024}'.
# Runs on the device machine, vLLM from ../shared/gpu-vllm.
set -euo pipefail
shape=$1 out=$3 rate=${4:-24}
IFS=, read -ra backends <<<"$2"
(( ${#backends[@]} <= 2 )) || { echo "at most two backends share a GPU" >&2; exit 2; }
memory=()
(( ${#backends[@]} == 1 )) || memory=(--gpu-memory-utilization "${GPU_UTIL:-0.45}" \
  --kv-cache-memory-bytes $(( ${KV_GIB:-24} << 30 )))
source "$(dirname "$0")/device_model.sh"
device_model "$shape"

servers=()
trap 'kill "${servers[@]}" 2>/dev/null; wait 2>/dev/null || true' EXIT
start() {  # BACKEND PORT: a server in the background
  local backend=$1 port=$2 mode=() moe fp8_gemm=()
  case $backend in
    stock|kittens) ;;
    stock-deterministic|kittens-deterministic) mode=(--deterministic) ;;
    kittens-deterministic-cutlass) mode=(--deterministic) fp8_gemm=(MOK_DETERMINISTIC_FP8_GEMM=cutlass) ;;
    *) echo "BACKEND must be stock or kittens, either with -deterministic, or kittens-deterministic-cutlass" >&2
       exit 2 ;;
  esac
  case $backend in stock*) moe=auto ;; *) moe=kittens ;; esac
  mkdir -p "$out/$backend"
  env "${fp8_gemm[@]}" mok-serve "$model" --moe-backend "$moe" "${mode[@]}" --served-model-name "$shape" --port "$port" \
    --load-format dummy --attention-backend TRITON_ATTN --max-model-len 8192 "${memory[@]}" ${SERVE_ARGS:-} \
    >"$out/$backend/server.log" 2>&1 &
  servers+=($!)
}
wait_up() {  # BACKEND PORT PID: bounded at 400 s (a start is ~150 s alone)
  for _ in $(seq 400); do
    curl -sf "localhost:$2/health" >/dev/null && { echo "$1 serving after $SECONDS s"; return; }
    kill -0 "$3" 2>/dev/null || { tail -30 "$out/$1/server.log"; exit 1; }
    sleep 1
  done
  echo "$1: server not up after 400 s" >&2; exit 1
}
measure() {  # BACKEND PORT
  mok-loadtest serve --url "$1=http://127.0.0.1:$2" --model "$model" \
    $(for w in ${WORKLOADS:-512:256:c=1,8,32,128,256:rate=$rate 4096:64:c=1,32}; do echo --workload "$w"; done) \
    --num-requests 8 --requests-per-stream 2 --rate-seconds 20 --max-duration 40 --no-progress --no-history \
    --out "$out/$1" || true
  if [[ ${BENCH:-0} == 1 ]]; then
    python3 -m vllm.entrypoints.cli.main bench serve --base-url "http://127.0.0.1:$2" --model "$shape" \
      --tokenizer "$model" --dataset-name random --random-input-len 512 --random-output-len 256 --num-prompts 64 \
      --max-concurrency 32 --num-warmups 32 --ignore-eos --seed 1 --disable-tqdm \
      --save-result --result-dir "$out/$1" --result-filename vllm_bench.json
  fi
  echo "$1 done after $SECONDS s"
}

port=${PORT:-8321}
for i in "${!backends[@]}"; do start "${backends[i]}" $((port + i)); done
for i in "${!backends[@]}"; do wait_up "${backends[i]}" $((port + i)) "${servers[i]}"; done
for i in "${!backends[@]}"; do measure "${backends[i]}" $((port + i)); done
