"""mok-loadtest step-profile: where one decode step's GPU time goes, for one request alone (c=1) or
``--batch N`` requests decoding together (c=N), and with ``--prefill-prompts P`` where a prefill of P
prompts together goes.

Builds MODEL in this process with vLLM's offline engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the
torch profiler sees the model's kernels; vLLM's defaults otherwise: torch.compile, CUDA graphs),
then profiles two greedy generations of the same ``--batch`` random prompts, submitted together: 1
output token each (the prefill) and 1 + ``--decode-steps`` tokens each. Their difference, divided by
the steps, is one decode step of ``--batch`` sequences: wall time (of a run without the profiler),
and GPU kernel time by kernel and by kind (dense GEMM, MoE, attention, norms, sampling, other).
``--prefill-prompts P`` also profiles one generation of 1 token for each of P different random prompts
of ``--input-len`` tokens, submitted together (vLLM chunks them into steps of its default
batched-token budget): the prefill-heavy end of serving. ``--deterministic`` runs vLLM's
batch-invariant mode (``VLLM_BATCH_INVARIANT=1``; with ``--moe-backend kittens`` kittens' invariant
kernels and CUDA graphs up to 8192 tokens too), as ``mok-serve --deterministic``.

Output: ``step_profile_<label>.{json,md}`` in ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import pathlib
import re
import sys
import time

# Kinds of kernels, first match wins (kernel names of vLLM 0.32, Triton, cuBLAS/CUTLASS, kittens).
KINDS = (
    ("moe", r"moe|expert|topk_weight|_combine|_fp8_gemm[12]_kernel|_fp8_schedule"),  # (kittens' block-FP8 experts)
    ("attention", r"attention|attn|reshape_and_cache|rotary|rope"),
    ("dense gemm", r"gemm|matmul|_linear_kernel|_linear_reduce|cutlass|xmma|nvjet|gemv|sm90|splitk"),
    ("norm", r"rms|norm"),
    ("sampling/logits", r"softmax|sampl|argmax|topk|top_k|logit|gumbel|exponential"),
)


def kind_of(kernel: str) -> str:
    name = kernel.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, name):
            return kind
    return "other"


def kernel_times_us(prof) -> tuple[dict[str, float], int]:
    """Total GPU time (us) per kernel name of a finished torch profiler, and how many kernels ran
    (kernels inside CUDA-graph replays included: CUPTI reports each)."""
    import torch

    totals: dict[str, float] = collections.defaultdict(float)
    count = 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.time_range.elapsed_us()
            count += 1
    return totals, count


def decode_step(short: dict[str, float], long: dict[str, float], steps: int) -> dict[str, float]:
    """Per-kernel GPU us of one decode step: (long run - short run) / steps, kernels of the long run."""
    return {k: (v - short.get(k, 0.0)) / steps for k, v in long.items() if v - short.get(k, 0.0) > 0}


def by_kind(per_kernel: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = collections.defaultdict(float)
    for name, us in per_kernel.items():
        out[kind_of(name)] += us
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def summary(per_kernel: dict[str, float], wall_ms: float, kernels: float) -> dict:
    """Wall time, GPU kernel time, kernels run, time by kind and the 30 longest kernels of a profiled
    span. Wall time well above kernel time with many kernels says the host's launches bound the span."""
    return dict(wall_ms=wall_ms, gpu_us=sum(per_kernel.values()), kernels=kernels, by_kind_us=by_kind(per_kernel),
                top_kernels_us=sorted(per_kernel.items(), key=lambda kv: -kv[1])[:30])


def _tables(part: dict, unit: str) -> list[str]:
    lines = [f"| kind | us {unit} | share |", "|---|---|---|"]
    for kind, us in part["by_kind_us"].items():
        lines.append(f"| {kind} | {us:.1f} | {us / max(part['gpu_us'], 1e-9):.1%} |")
    lines += ["", f"| kernel | kind | us {unit} |", "|---|---|---|"]
    for name, us in part["top_kernels_us"]:
        lines.append(f"| `{name[:90]}` | {kind_of(name)} | {us:.1f} |")
    return lines


def markdown(result: dict) -> str:
    step = result["decode_step"]
    lines = [f"# One decode step at c={result['batch']}: {result['label']}", "",
             f"- model `{result['model']}`, `--moe-backend {result['moe_backend']}`, deterministic: "
             f"{result['deterministic']}; {result['gpu']}, commit {result['commit']}, vLLM {result['vllm']}",
             f"- {result['batch']} prompt(s) of {result['input_len']} tokens, {result['decode_steps']} decode "
             "steps measured",
             *([f"- compilation config: `{json.dumps(result['compilation_config'])}`"]
               if result.get("compilation_config") else []),
             f"- wall time per decode step: {step['wall_ms']:.3f} ms; GPU kernel time: {step['gpu_us'] / 1e3:.3f} ms; "
             f"kernels: {step['kernels']:.0f}", "",
             *_tables(step, "per step")]
    prefill = result.get("prefill")
    if prefill:
        lines += ["", f"## Prefill of {prefill['prompts']} prompts x {result['input_len']} tokens together "
                  f"({prefill['prompts'] * result['input_len']} tokens, 1 output token each)", "",
                  f"- wall time: {prefill['wall_ms']:.1f} ms; GPU kernel time: {prefill['gpu_us'] / 1e3:.1f} ms; "
                  f"kernels: {prefill['kernels']}", "",
                  *_tables(prefill, "in all")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mok-loadtest step-profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="model path (e.g. from mok-serve build-model) or name")
    p.add_argument("--moe-backend", default="kittens", help="kittens, or a stock value such as triton (default: kittens)")
    p.add_argument("--deterministic", action="store_true", help="vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1)")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--batch", type=int, default=1,
                   help="sequences decoding together in the profiled steps (c=N; default: 1)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--prefill-prompts", type=int, default=0,
                   help="also profile the prefill of this many --input-len prompts submitted together (default: 0, off)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--compilation-config", type=json.loads, default=None,
                   help="vLLM's compilation config as JSON, e.g. '{\"max_cudagraph_capture_size\": 1024}' "
                        "(default: vLLM's)")
    p.add_argument("--label", default=None, help="result file label (default: backend and mode)")
    p.add_argument("--out", default=".", help="folder for step_profile_<label>.{json,md}")
    args = p.parse_args(argv)
    if args.input_len < 1 or args.decode_steps < 1 or args.batch < 1 or args.prefill_prompts < 0:
        p.error("--input-len, --decode-steps and --batch must be >= 1, --prefill-prompts >= 0")
    if args.input_len + args.decode_steps + 1 > args.max_model_len:
        p.error("--input-len + --decode-steps + 1 must fit in --max-model-len")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.deterministic:
        os.environ["VLLM_BATCH_INVARIANT"] = "1"
    import torch

    if not torch.cuda.is_available():
        print("step-profile needs a CUDA GPU", file=sys.stderr)
        return 2
    import vllm
    from vllm import LLM, SamplingParams

    from mok_serve.plugin import register

    from .. import provenance

    register()  # --moe-backend kittens and the kittens-random load format in this process

    kwargs = dict(model=args.model, load_format=args.load_format, moe_backend=args.moe_backend,
                  max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
                  enable_prefix_caching=False)
    if args.attention_backend:
        kwargs["attention_backend"] = args.attention_backend
    if args.compilation_config:
        kwargs["compilation_config"] = args.compilation_config
    llm = LLM(**kwargs)
    vocab = llm.get_tokenizer().vocab_size
    g = torch.Generator().manual_seed(0)

    def random_prompt() -> dict:
        return {"prompt_token_ids": torch.randint(100, min(vocab, 30000), (args.input_len,), generator=g).tolist()}

    def run(prompts: list[dict], tokens: int) -> tuple[tuple[dict[str, float], int], float]:
        params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)  # warm: same shapes, nothing compiles inside the profile
        torch.cuda.synchronize()
        # Wall time without the profiler, which adds host time to every launch (an eager 600-token
        # step: ~180 ms profiled, ~110 ms not).
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
        return kernel_times_us(prof), wall

    prompts = [random_prompt() for _ in range(args.batch)]
    (short, short_count), wall_short = run(prompts, 1)
    (long, long_count), wall_long = run(prompts, 1 + args.decode_steps)
    per_kernel = decode_step(short, long, args.decode_steps)
    label = args.label or f"{args.moe_backend}{'-deterministic' if args.deterministic else ''}"
    result = dict(
        label=label, model=args.model, moe_backend=args.moe_backend, deterministic=args.deterministic,
        input_len=args.input_len, decode_steps=args.decode_steps, batch=args.batch, gpu=torch.cuda.get_device_name(),
        compilation_config=args.compilation_config,
        commit=provenance.git_commit(), vllm=vllm.__version__, date=datetime.datetime.now(datetime.UTC).isoformat(),
        decode_step=summary(per_kernel, (wall_long - wall_short) / args.decode_steps * 1e3,
                            (long_count - short_count) / args.decode_steps),
    )
    if args.prefill_prompts:
        (prefill, count), wall = run([random_prompt() for _ in range(args.prefill_prompts)], 1)
        result["prefill"] = dict(summary(prefill, wall * 1e3, count), prompts=args.prefill_prompts)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"step_profile_{label}.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (out / f"step_profile_{label}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
