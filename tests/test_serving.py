"""Real `mok-serve` servers on the CPU: the OpenAI API through the official client, kittens vs
the stock backend, batch invariance, CPU tensor parallel + expert parallel, start-up errors."""

from concurrent.futures import ThreadPoolExecutor

import pytest
from serving_utils import PROMPTS, client, greedy, greedy_all, model_id

from mok_serve import tiny_models
from mok_serve.server_process import ServerError, ServerProcess

pytestmark = pytest.mark.server

COMMON = ["--max-model-len", "1024"]
KITTENS_LINE = "run mok-serve's kittens experts"


@pytest.fixture(scope="module")
def kittens_server():
    # No model: mok-serve builds and serves the embedded default with --moe-backend kittens.
    with ServerProcess(COMMON) as server:
        yield server


@pytest.fixture(scope="module")
def stock_server():
    model = str(tiny_models.build_tiny_model())
    with ServerProcess([model, "--moe-backend", "auto", *COMMON]) as server:
        yield server


def test_models_endpoint(kittens_server):
    models = client(kittens_server).models.list().data
    assert len(models) == 1
    assert f"tiny-{tiny_models.DEFAULT_FAMILY}" in models[0].id


def test_completions_and_chat(kittens_server):
    c, model = client(kittens_server), model_id(kittens_server)
    completion = c.completions.create(model=model, prompt="Hello", max_tokens=8, temperature=0)
    assert completion.usage.completion_tokens == 8 and completion.choices[0].text

    streamed = c.completions.create(model=model, prompt="Hello", max_tokens=8, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == completion.choices[0].text

    messages = [{"role": "user", "content": "Tell me about kittens."}]
    chat = c.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content
    assert chat.usage.completion_tokens == 12

    stream = c.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0, stream=True)
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert "".join(pieces) == chat.choices[0].message.content


def test_kittens_runs_the_moe_layers(kittens_server):
    log = kittens_server.log()
    assert log.count(KITTENS_LINE) == 1, "the kittens line must be logged once per process"
    assert "Using KittensExperts MoE backend" in log


def test_stock_backend_is_untouched(stock_server):
    log = stock_server.log()
    assert KITTENS_LINE not in log and "KittensExperts" not in log
    assert "CPUUnquantizedExperts MoE backend" in log


def test_greedy_equals_stock(kittens_server, stock_server):
    assert greedy_all(kittens_server) == greedy_all(stock_server)


def test_greedy_is_batch_invariant(kittens_server):
    prompt = PROMPTS[1]
    alone = greedy(kittens_server, prompt, max_tokens=32)
    others = [f"{PROMPTS[i % len(PROMPTS)]} (variant {i})" for i in range(15)]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda p: greedy(kittens_server, p, max_tokens=32), [prompt, *others]))
    assert together[0] == alone


def test_tensor_parallel_2_expert_parallel_equals_tp1(kittens_server):
    expected = greedy_all(kittens_server)
    with ServerProcess(["--tensor-parallel-size", "2", "--enable-expert-parallel", *COMMON]) as tp2:
        assert greedy_all(tp2) == expected
        log = tp2.log()
        assert "Using KittensExperts MoE backend" in log
        # kittens owns dispatch and combine: vLLM's passthrough all-to-all, our shared-memory pull.
        assert "Using PassThroughPrepareAndFinalize" in log
        assert "kittens EP: rank 0 of 2 dispatches and combines over shared memory (replicated tokens)" in log


def test_data_parallel_2_expert_parallel_equals_tp1(kittens_server):
    expected = greedy_all(kittens_server)
    with ServerProcess(["--data-parallel-size", "2", "--enable-expert-parallel", *COMMON]) as dp2:
        assert greedy_all(dp2, concurrent=True) == expected
        log = dp2.log()
        for rank in (0, 1):
            assert f"kittens EP: rank {rank} of 2 dispatches and combines over shared memory (per-rank tokens)" in log


def test_quantized_model_fails_at_start_up():
    server = ServerProcess(["--quantization", "fp8", *COMMON])
    with pytest.raises(ServerError, match="kittens runs unquantized MoE layers only.*quantized with 'fp8'"):
        server.start()


OTHER_FAMILIES = [
    f for f in sorted(tiny_models.FAMILIES) if f != tiny_models.DEFAULT_FAMILY and f not in tiny_models.UNSERVABLE_ON_CPU
]


@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_family_served_by_kittens_equals_stock(family):
    model = str(tiny_models.build_tiny_model(family))
    with ServerProcess([model, *COMMON]) as kittens:
        ours = greedy_all(kittens, PROMPTS[:3])
        assert "Using KittensExperts MoE backend" in kittens.log()
    with ServerProcess([model, "--moe-backend", "auto", *COMMON]) as stock:
        assert greedy_all(stock, PROMPTS[:3]) == ours
