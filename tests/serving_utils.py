"""Helpers for tests that talk to real servers."""

import importlib.util
from concurrent.futures import ThreadPoolExecutor

import pytest

# Real servers need vLLM and the official client. Where they are missing (the GPU machines, where
# `pytest -m gpu tests` collects every module) the server test modules are skipped at import.
if importlib.util.find_spec("vllm") is None:
    pytest.skip("real servers need vLLM", allow_module_level=True)
openai = pytest.importorskip("openai")

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a kingdom by the sea,",
    "def fibonacci(n):",
    "Kittens are small cats that",
    "The mixture of experts layer routes each token",
    "In 1969 the first person walked on",
]


def client(server, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0, timeout=300)


def model_id(server) -> str:
    return client(server).models.list().data[0].id


def greedy(server, prompt: str, max_tokens: int = 24) -> str:
    c = client(server)
    out = c.completions.create(model=model_id(server), prompt=prompt, max_tokens=max_tokens, temperature=0)
    return out.choices[0].text


def greedy_all(server, prompts=PROMPTS, max_tokens: int = 24, concurrent: bool = False) -> list[str]:
    if not concurrent:
        return [greedy(server, p, max_tokens) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: greedy(server, p, max_tokens), prompts))


def greedy_logprobs(server, prompts=PROMPTS, max_tokens: int = 24) -> list[tuple[list[str], list[list[float]]]]:
    """Per prompt: the greedy tokens and, at each of them, the two highest logprobs (descending)."""
    c, model = client(server), model_id(server)
    out = []
    for p in prompts:
        lp = c.completions.create(model=model, prompt=p, max_tokens=max_tokens, temperature=0, logprobs=2)
        lp = lp.choices[0].logprobs
        out.append((lp.tokens, [sorted(top.values(), reverse=True) for top in lp.top_logprobs]))
    return out
