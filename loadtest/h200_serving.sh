#!/usr/bin/env bash
# Kittens vs stock (vLLM's own MoE choice) on one H200 with a real-shape model and dummy weights:
# the decode-heavy and prefill-heavy grid of the GPU load-test issue, with vLLM's defaults (CUDA
# graphs, torch.compile, chunked prefill). One backend per call, as a server start takes ~2.5 min
# and one device call cannot hold two starts and both grids:
#   bash loadtest/h200_serving.sh SHAPE BACKEND OUT [RATE]    # BACKEND: stock or kittens, either with
#                                                             # -deterministic (mok-serve --deterministic)
# RATE (req/s, default 24) is meant to sit just below saturation: about 0.9 x the output tok/s of
# the c=128 run / 256 tokens (Qwen3-30B-A3B bf16: 18; the 6-layer DeepSeek-V3 shape bf16: 12).
# Above it requests pile up and the run measures the backlog (the report's requests in flight).
#   mok-loadtest merge OUT/stock OUT/kittens --out OUT        # after both: one report (and the history.csv rows)
# Results go to OUT/BACKEND (results.json, report.md, plots, server.log). With BENCH=1, vLLM's own
# `vllm bench serve` then measures the 512/256 concurrency-32 point on the same server
# (OUT/BACKEND/vllm_bench.json) for the cross-check. WORKLOADS="512:256:c=1,64 ..." replaces the
# grid (e.g. a short check). PORT (default 8321) lets servers on different GPUs of one machine run
# side by side (CUDA_VISIBLE_DEVICES picks each one's GPU). Set MOK_COMMIT where the tree has no .git.
# Runs on the device machine, vLLM from ../shared/gpu-vllm.
set -euo pipefail
shape=$1 backend=$2 out=$3 rate=${4:-24}
mode=()
case $backend in *-deterministic) mode=(--deterministic) ;; esac
case ${backend%-deterministic} in stock) moe=auto ;; kittens) moe=kittens ;;
  *) echo "BACKEND must be stock or kittens, either with -deterministic" >&2; exit 2 ;; esac
model=/tmp/models/$shape dir=$out/$backend port=${PORT:-8321}
mkdir -p "$dir"
mkdir -p /tmp/models && flock /tmp/models/.lock mok-serve build-model --shape "$shape" --out "$model"
[[ $shape == deepseek* ]] && export VLLM_MLA_DISABLE=1  # the kit has no FlashAttention/FlashInfer for MLA
mok-serve "$model" --moe-backend "$moe" "${mode[@]}" --served-model-name "$shape" --port $port --load-format dummy \
  --attention-backend TRITON_ATTN --max-model-len 8192 >"$dir/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 400); do  # start-up is ~150 s; bounded at 400 s
  curl -sf "localhost:$port/health" >/dev/null && break
  kill -0 $server 2>/dev/null || { tail -30 "$dir/server.log"; exit 1; }
  sleep 1
done
curl -sf "localhost:$port/health" >/dev/null || { echo "server not up after 400 s" >&2; exit 1; }
echo "$backend serving after $SECONDS s"
mok-loadtest serve --url "$backend=http://127.0.0.1:$port" --model "$model" \
  $(for w in ${WORKLOADS:-512:256:c=1,8,32,128,256:rate=$rate 4096:64:c=1,32}; do echo --workload "$w"; done) \
  --num-requests 8 --requests-per-stream 2 --rate-seconds 20 --max-duration 40 --no-progress --no-history --out "$dir" || true
if [[ ${BENCH:-0} == 1 ]]; then
  python3 -m vllm.entrypoints.cli.main bench serve --base-url "http://127.0.0.1:$port" --model "$shape" --tokenizer "$model" \
    --dataset-name random --random-input-len 512 --random-output-len 256 --num-prompts 64 \
    --max-concurrency 32 --num-warmups 32 --ignore-eos --seed 1 --disable-tqdm \
    --save-result --result-dir "$dir" --result-filename vllm_bench.json
fi
echo "$backend done after $SECONDS s"
