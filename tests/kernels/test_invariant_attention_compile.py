"""Batch-invariant paged attention's kernels compile for Hopper (sm_90a) without a GPU, on both
paths and both layouts (operands swapped for decode) and for the head groups of the served
shapes, on bf16 wgmma alone, without register spills; and with the per-call counts and the
block table's stride at 1 (Triton passes those as constants). Same method as
tests/kernels/test_triton_moe_compile.py."""

import pytest
from sm90_compile import SHARED_BYTES, compile_for_sm90, no_spills

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
                    st = 48  # q, out and cache strides as served tensors have them: multiples of 16 elements
                    ints = dict(num_seqs=n, window=n, max_segs=n, stride_bt=n, stride_qt=st, stride_qh=st,
                                stride_ot=st, stride_oh=st, stride_kb=st, stride_ks=st, stride_kh=st, stride_vb=st,
                                stride_vs=st, stride_vh=st)
                    consts = dict(GROUP=group, BLOCK_Q=block_m // triton.next_power_of_2(group), BLOCK_M=block_m,
                                  HEAD=head, SEG=SEGMENT, HAS_WINDOW=window)
                    tag = f"g{group}_sw{int(swap)}_w{int(window)}_o{int(ones)}"
                    build(f"attn_{tag}_s{int(split)}", att._attention_kernel, ptrs, ints,
                          dict(consts, PAGE=16, HEAD_A=head, HEAD_B=0, SWAP=swap, SPLIT=split, DOT_F32=False, PDL=True), att.num_warps(swap),
                          att.num_stages(head, 2, swap))
                    if split and swap:  # the merge runs 16-row blocks after either layout
                        build(f"merge_{tag}", att._attention_merge_kernel, ptrs,
                              {k: ints[k] for k in ("num_seqs", "window", "max_segs", "stride_ot", "stride_oh")},
                              dict(consts, WIDTH=head, COLS=min(head, 32), PDL=True), 4, 2)
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


HEAD_192 = r"""
from mok_serve.kernels.cuda import attention as att
from mok_serve.kernels.attention import SEGMENT

for dtype, itemsize in (("bf16", 2), ("fp32", 4)):
    ptrs = dict(q_ptr=f"*{dtype}", k_ptr=f"*{dtype}", v_ptr=f"*{dtype}", out_ptr=f"*{dtype}", cu_q_ptr="*i32",
                seq_lens_ptr="*i32", bt_ptr="*i32", part_ptr="*fp32", ml_ptr="*fp32", scale="fp32")
    # strides as a served cache has them (multiples of 16 elements: Triton marks them so)
    ints = dict(num_seqs=7, window=7, max_segs=7, stride_qt=48, stride_qh=48, stride_ot=48, stride_oh=48,
                stride_bt=48, stride_kb=48, stride_ks=48, stride_kh=48, stride_vb=48, stride_vs=48, stride_vh=48)
    for swap in (False, True):
        block_m = att.DECODE_ROWS if swap else att.PREFILL_ROWS
        for split in (False, True):
            consts = dict(GROUP=1, BLOCK_Q=block_m, BLOCK_M=block_m, HEAD=192, HEAD_A=128, HEAD_B=64, SEG=SEGMENT,
                          HAS_WINDOW=False, PAGE=16, SWAP=swap, SPLIT=split, DOT_F32=dtype == "fp32", PDL=True)
            build(f"attn_{dtype}_sw{int(swap)}_s{int(split)}", att._attention_kernel, ptrs, ints, consts,
                  att.num_warps(swap), att.num_stages(192, itemsize, swap))

"""


@pytest.mark.timeout(600)
def test_head_192_runs_as_two_wgmma_tiles_within_shared_memory_in_bf16_and_fp32(tmp_path):
    """DeepSeek-V3's 192-wide heads (MLA off) run as tiles of 128 and 64 columns: in bf16 on wgmma
    alone (both layouts give an element the same bits only on one instruction type), with K, V and
    q loaded in 16-byte vectors (no 2-byte load: the segment loops count from 0) and no register
    spills, and in fp32 with one pipeline stage where two copies of K and V would not fit."""
    results = compile_for_sm90(HEAD_192, tmp_path)
    assert len(results) == 8
    for name, r in results.items():
        assert r["shared"] <= SHARED_BYTES, (name, r["shared"])
        if "bf16" in name:
            assert r["bf16_wgmma"] and not r["mma_sync"], f"{name}: not (only) bf16 wgmma"
            assert r["scalar_16bit_loads"] == 0, (name, r["scalar_16bit_loads"])
            assert no_spills(r["ptxas"]), (name, r["ptxas"])
