# Where the host time of one eager 600-token prefill step goes (cProfile), kittens --deterministic; produced
# cprofile_prefill600_fp8_kittens-deterministic_32b5d5a_h100.log.gz (MODEL: a build-model path). Run on the GPU machine
# with vLLM staged: python3 cprofile_prefill600.py /tmp/models/qwen3-30b-a3b-fp8
import cProfile, os, pstats, sys, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["VLLM_BATCH_INVARIANT"] = "1"
import torch
from vllm import LLM, SamplingParams
from mok_serve.plugin import register
register()
llm = LLM(model=sys.argv[1], load_format="dummy", moe_backend="kittens", max_model_len=4096,
          gpu_memory_utilization=0.9, enable_prefix_caching=False, attention_backend="TRITON_ATTN",
          # vLLM's default ceiling (and the server's at 32b5d5a, when this ran): the 600-token step runs eagerly
          compilation_config={"max_cudagraph_capture_size": 512})
g = torch.Generator().manual_seed(0)
prompts = [{"prompt_token_ids": torch.randint(100, 30000, (600,), generator=g).tolist()}]
params = SamplingParams(max_tokens=1, min_tokens=1, temperature=0.0, ignore_eos=True)
for _ in range(3):
    torch.cuda.synchronize(); t0 = time.perf_counter(); llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize(); print("wall ms", (time.perf_counter() - t0) * 1e3)
prof = cProfile.Profile()
prof.enable(); llm.generate(prompts, params, use_tqdm=False); torch.cuda.synchronize(); prof.disable()
st = pstats.Stats(prof); st.sort_stats("cumulative").print_stats(70); st.sort_stats("tottime").print_stats(50)
