"""The expert-parallel transport kernels (gather, combine and, across nodes, collect) compile for
Hopper (sm_90a) without a GPU, on one node and across nodes, bf16 and FP8 rows, whatever the node
layout's integers are (1 arrives as a constant: one rank per node, the first node, a 1-token call),
without register spills and with programmatic dependent launch. Same method as
tests/kernels/test_triton_moe_compile.py (sm90_compile.py)."""

import pytest
from sm90_compile import compile_for_sm90, no_spills

pytest.importorskip("triton")

BODY = r"""
from mok_serve.kernels.cuda import ep_kernels as ep

H, K, E = 7168, 8, 256  # DeepSeek-V3
tab = ptr("i64")
# (node_size, my_node, local_index, max_tokens): 2 nodes of 8 (last node), 1 rank per node (first), a 1-token call
LAYOUTS = ((8, 1, 3, 128), (1, 0, 0, 64), (8, 0, 1, 1))
for across in (False, True):
    for fp8 in (False, True):
        for i, (node_size, node, index, tokens) in enumerate(LAYOUTS if across else LAYOUTS[:1]):
            build(f"gather_across{across}_fp8{fp8}_{i}", ep.ep_gather_kernel,
                  dict(ntab_ptr=tab, idtab_ptr=tab, xtab_ptr=tab, xstab_ptr=tab, all_ids_ptr=ptr("i32"),
                       xl_ptr=ptr("u8" if fp8 else "bf16"), xsl_ptr=ptr("fp32" if fp8 else "bf16"),
                       emap_ptr=ptr("i32"), queue_ptr=ptr("i32"), state_ptr=ptr("i64"), words_ptr=ptr("i32"),
                       inboxtab_ptr=tab, inboxstab_ptr=tab),
                  dict(max_tokens=tokens, H=H, G=H // 128, num_global=E, num_local=E // 16, node_size=node_size,
                       my_node=node),
                  dict(TOPK=K, K_PAD=K, BT=4, BLOCK_H=1024, COPY_ROWS=True, SCALES=fp8, BLOCK_G=64,
                       ACROSS_NODES=across, PDL=True))
    for i, (node_size, node, index, tokens) in enumerate(LAYOUTS if across else LAYOUTS[:1]):
        build(f"combine_across{across}_{i}", ep.ep_combine_kernel,
              dict(ytab_ptr=tab, ret_ptr=ptr("bf16"), out_ptr=ptr("bf16"), ids_ptr=ptr("i32"), w_ptr=ptr("fp32"),
                   owner_ptr=ptr("i32"), res_ptr=ptr("bf16")),
              dict(H=H, num_global=E, src_row0=3 * tokens * K, node_size=node_size, my_node=node,
                   rows_per_node=tokens * K, stride_it=K, stride_ik=1, stride_wt=K, stride_wk=1, stride_ot=H),
              dict(TOPK=K, PULL=True, ACROSS_NODES=across, BLOCK_H=1024, RNE_FIX=False, PDL=True))
for replicated in (False, True):
    for i, (node_size, node, index, tokens) in enumerate(LAYOUTS):
        build(f"collect_replicated{replicated}_{i}", ep.ep_collect_kernel,
              dict(ytab_ptr=tab, all_ids_ptr=ptr("i32"), owner_ptr=ptr("i32"), res_ptr=ptr("bf16")),
              dict(max_tokens=tokens, H=H, num_global=E, node_size=node_size, my_node=node, local_index=index),
              dict(TOPK=K, REPLICATED=replicated, BLOCK_H=1024, PDL=True))
"""


def test_ep_transport_kernels_compile_for_sm90_on_one_node_and_across_nodes(tmp_path):
    results = compile_for_sm90(BODY, tmp_path)
    assert len(results) == 8 + 4 + 6  # gather, combine, collect variants
    for name, r in results.items():
        assert no_spills(r["ptxas"]), f"{name} spills registers:\n{r['ptxas']}"
        assert r["grid_dependency"], f"{name}: no programmatic dependent launch"
