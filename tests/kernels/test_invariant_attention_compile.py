"""Batch-invariant paged attention's kernels compile for Hopper (sm_90a) without a GPU, on both
paths and both layouts (operands swapped for decode) and for the head groups of the served
shapes, on bf16 wgmma alone, without register spills; and with every
per-call integer at 1 (Triton passes those as constants). Same method as
tests/kernels/test_triton_moe_compile.py."""

import pytest
from sm90_compile import compile_for_sm90, no_spills

pytest.importorskip("triton")

BODY = r"""
from mok_serve.kernels.cuda import attention as att
from mok_serve.kernels.attention import SEGMENT

ptrs = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", out_ptr="*bf16", cu_q_ptr="*i32", seq_lens_ptr="*i32",
            bt_ptr="*i32", part_ptr="*fp32", ml_ptr="*fp32", scale="fp32")
for group, head in ((8, 128), (12, 128), (1, 64)):
    for swap in (False, True):
        block_m = att.DECODE_ROWS if swap else att.PREFILL_ROWS
        for window in (False, True):
            for split in (False, True):
                for ones in (False, True):
                    n = 1 if ones else 7
                    ints = dict(num_seqs=n, window=n, max_segs=n, stride_qt=n, stride_qh=n, stride_ot=n, stride_oh=n,
                                stride_bt=n, stride_kb=n, stride_ks=n, stride_kh=n, stride_vb=n, stride_vs=n,
                                stride_vh=n)
                    consts = dict(GROUP=group, BLOCK_Q=block_m // triton.next_power_of_2(group), BLOCK_M=block_m,
                                  HEAD=head, HEAD_PAD=head, SEG=SEGMENT, HAS_WINDOW=window)
                    tag = f"g{group}_sw{int(swap)}_w{int(window)}_o{int(ones)}"
                    build(f"attn_{tag}_s{int(split)}", att._attention_kernel, ptrs, ints,
                          dict(consts, PAGE=16, SWAP=swap, SPLIT=split, DOT_F32=False, PDL=True), att.num_warps(swap), 2)
                    if split and swap:  # the merge runs 16-row blocks after either layout
                        build(f"merge_{tag}", att._attention_merge_kernel, ptrs,
                              {k: ints[k] for k in ("num_seqs", "window", "max_segs", "stride_ot", "stride_oh")},
                              dict(consts, COLS=min(head, 32), PDL=True), 4, 2)
"""


@pytest.mark.timeout(900)
def test_attention_kernels_compile_for_sm90_with_bf16_wgmma_and_no_spills(tmp_path):
    """Every sum over keys or head dimensions on wgmma, never mma.sync: the swapped and unswapped
    layouts give an element the same bits only on the same instruction."""
    results = compile_for_sm90(BODY, tmp_path)
    assert len(results) == 3 * 2 * 2 * 2 * 2 + 3 * 2 * 2
    for name, r in results.items():
        assert no_spills(r["ptxas"]), (name, r["ptxas"])
        if name.startswith("attn_"):
            assert r["bf16_wgmma"] and not r["mma_sync"], f"{name}: not (only) bf16 wgmma"
