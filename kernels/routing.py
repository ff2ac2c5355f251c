"""Routing functions of the model families kittens serves: router logits -> (top-k weights, ids).

vLLM runs its own router before the experts; these are the same functions for tests, benchmarks
and anyone calling ``fused_moe`` outside vLLM. Weights are fp32, ids int32.
"""

import torch


def softmax_topk(
    router_logits: torch.Tensor, top_k: int, *, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE (and Mixtral) routing: softmax over experts, keep the top k, optionally renormalise."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def grouped_sigmoid_topk(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    correction_bias: torch.Tensor,
    num_groups: int = 1,
    topk_groups: int = 1,
    renormalize: bool = True,
    scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 / Kimi-K2 / GLM-4.5 routing.

    Scores are sigmoid(logits). The correction bias only chooses experts: groups are ranked by the
    sum of their two best biased scores, the best ``topk_groups`` groups stay, and the top k biased
    scores among them pick the experts. The weights are the unbiased scores of those experts,
    renormalised to sum to one if asked, then multiplied by ``scaling_factor``.
    """
    tokens, num_experts = router_logits.shape
    if num_experts % num_groups:
        raise ValueError(f"{num_experts} experts do not split into {num_groups} groups")
    scores = torch.sigmoid(router_logits.float())
    choice = scores + correction_bias.float()
    if num_groups > 1:
        grouped = choice.view(tokens, num_groups, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_groups, dim=-1).indices, 1.0)
        mask = keep.unsqueeze(-1).expand_as(grouped).reshape(tokens, num_experts)
        choice = choice.masked_fill(mask == 0, float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling_factor, ids.to(torch.int32)
