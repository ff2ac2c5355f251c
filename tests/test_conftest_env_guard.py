"""The conftest's guard against tests that leave mok-serve's environment variables changed."""

import os

from conftest import _guarded_env, restore_guarded_env


def test_a_leaked_variable_is_named_and_put_back(monkeypatch):
    monkeypatch.setenv("MOK_TEST_GUARD_KEPT", "1")
    monkeypatch.setenv("VLLM_CPU_TEST_GUARD_GONE", "a")
    before = _guarded_env()
    os.environ["VLLM_CPU_TEST_GUARD_GONE"] = "b"  # changed
    del os.environ["MOK_TEST_GUARD_KEPT"]  # removed
    os.environ["VLLM_BATCH_INVARIANT_TEST_GUARD"] = "1"  # added
    os.environ["VLLM_UNGUARDED_TEST_GUARD"] = "1"  # vLLM's own kind: not guarded
    try:
        assert restore_guarded_env(before) == ["MOK_TEST_GUARD_KEPT", "VLLM_BATCH_INVARIANT_TEST_GUARD",
                                               "VLLM_CPU_TEST_GUARD_GONE"]
        assert _guarded_env() == before
        assert restore_guarded_env(before) == []
    finally:
        del os.environ["VLLM_UNGUARDED_TEST_GUARD"]
