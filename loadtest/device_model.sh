# Sourced by h200_serving.sh and h200_check.sh: `device_model SHAPE` builds (once per machine, under a
# lock so side-by-side calls share it) the dummy-weight model of a `mok-serve build-model` shape at
# /tmp/models, keeping WEIGHT_GIB of weights where set, and sets `model` to its path. build-model's
# report goes to stdout: the caller keeps it in its log or drops it. DeepSeek shapes
# serve their attention as MHA (VLLM_MLA_DISABLE=1): the vLLM kit has no FlashAttention/FlashInfer for MLA.
device_model() {
  model=/tmp/models/$1${WEIGHT_GIB:+-$WEIGHT_GIB}
  mkdir -p /tmp/models && flock /tmp/models/.lock mok-serve build-model --shape "$1" --out "$model" \
    ${WEIGHT_GIB:+--weight-gib "$WEIGHT_GIB"}
  if [[ $1 == deepseek* ]]; then export VLLM_MLA_DISABLE=1; fi
}
