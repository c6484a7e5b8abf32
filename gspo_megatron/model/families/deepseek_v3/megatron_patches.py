"""Where megatron-core 0.16.1 routes DeepSeek-V3 unlike transformers, and the change that fixes it.

Node-limited routing. transformers' DeepseekV3TopkRouter.forward scores each of the `n_group`
groups by the sum of its top-2 biased sigmoid scores (`.topk(2, dim=-1)[0].sum(dim=-1)`), keeps the
best `topk_group` groups, then takes the top-k experts among theirs. Megatron-Core's
`moe_utils.group_limited_topk` (transformer/moe/moe_utils.py:551-555) scores a group by the sum
of its top (topk // group_topk) scores instead: the same only when topk // topk_group == 2
(DeepSeek-V3 itself: 8 // 4). With 8 experts in 2 groups, top-4 from 1 group, the two choose
different groups for scores such as [.9 .8 0 0 | .5 .5 .5 .5] (tests/test_deepseek_v3.py).

`install` rebinds the module global `moe_utils.group_limited_topk` (looked up at call time by
topk_routing_with_score_function's `_compute_topk`, moe_utils.py:688, which routing replay also
calls through) to `group_limited_topk` below: top-2 group scores, otherwise Megatron's steps. It is
the reference's rule for every family here (only this one allows n_group > 1; GLM-4.5 refuses
it), so installing it in a process is safe for the others. tests/test_deepseek_v3.py pins the
line it replaces in the installed source and checks the result against transformers' router.
"""
from __future__ import annotations

import torch

#: the group score of the installed megatron-core this replaces (pinned by a test)
PINNED_SOURCE_LINE = "scores.view(num_tokens, num_groups, -1).topk(topk // group_topk, dim=-1)[0].sum(dim=-1)"
#: experts per group whose scores make a group's score, as transformers' DeepseekV3TopkRouter
GROUP_SCORE_TOP = 2


def group_limited_topk(scores: torch.Tensor, topk: int, num_tokens: int, num_experts: int, num_groups: int,
                       group_topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's group_limited_topk (same signature and results' layout) with transformers' group
    score: the sum of each group's top-2 scores."""
    group_scores = scores.view(num_tokens, num_groups, -1).topk(GROUP_SCORE_TOP, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = (group_mask.unsqueeze(-1).expand(num_tokens, num_groups, num_experts // num_groups)
                  .reshape(num_tokens, -1))
    masked = scores.masked_fill(~score_mask.bool(), float("-inf"))
    return torch.topk(masked, k=topk, dim=-1)


def megatron_group_limited_topk():
    """The installed megatron-core's own group_limited_topk, patched or not (tests compare)."""
    from megatron.core.transformer.moe import moe_utils

    current = moe_utils.group_limited_topk
    return getattr(current, "replaced", current)


def install() -> None:
    """Rebind megatron.core.transformer.moe.moe_utils.group_limited_topk (idempotent)."""
    from megatron.core.transformer.moe import moe_utils

    if moe_utils.group_limited_topk is not group_limited_topk:
        group_limited_topk.replaced = moe_utils.group_limited_topk
        moe_utils.group_limited_topk = group_limited_topk
