"""Which drafts the target accepts, and the bonus token: greedy (match the target's argmax) or rejection sampling
(accept x with min(1, q(x)/p(x)), else sample the bonus from norm(max(0, q - p))), like gpt-fast's `speculative_decode`.

Chains are accepted for every row at once with tensors, with no host sync per drafted token; trees are walked node by
node, siblings in the order the proposer ranked them.
"""

from __future__ import annotations

import torch

from draftline.engines.base import SamplingParams
from draftline.engines.reference.drafts import ChainDrafts, DraftTree
from draftline.engines.reference.sequence import Sequence


def target_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Sampling distribution over the last dim (temperature, then nucleus top-p), in float32."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def pick(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from the target's logits [V]: its argmax, or a sample."""
    if params.temperature == 0:
        return int(logits.argmax())
    return sample(target_probs(logits, params.temperature, params.top_p), generator)


def accept_chains(drafts: ChainDrafts, logits: torch.Tensor, sequences: list[Sequence]):
    """logits [B, S+1, V]: the target at the root and each draft -> (accepted drafts per row [B], bonus token per
    row [B]), both tensors on the logits' device. Greedy rows keep the longest prefix of drafts equal to the target's
    argmax; sampled rows run rejection sampling, each with its own generator."""
    target_argmax = logits.argmax(dim=-1)  # [B, S+1]
    matches = drafts.tokens == target_argmax[:, : drafts.steps]
    accepted = matches.long().cumprod(dim=1).sum(dim=1)
    bonus = target_argmax.gather(1, accepted[:, None])[:, 0]
    for row, sequence in enumerate(sequences):
        if not sequence.greedy:
            accepted[row], bonus[row] = _sampled_chain(
                drafts.tokens[row], drafts.draft_probs[row], logits[row], sequence.params, sequence.generator
            )
    return accepted, bonus


def _sampled_chain(tokens, draft_probs, logits, params: SamplingParams, generator):
    """Rejection sampling along one chain: tokens [S], draft_probs [S, V] (p), logits [S+1, V] (q from them) ->
    (accepted count, bonus token) as 0-d tensors. A draft past the first rejection is never accepted."""
    steps = tokens.shape[0]
    q = target_probs(logits, params.temperature, params.top_p)  # [S+1, V]
    p = torch.cat([draft_probs, draft_probs.new_zeros(1, q.shape[1])]) if steps else torch.zeros_like(q)
    drafted = torch.arange(steps, device=q.device)
    accept_prob = (q[drafted, tokens] / p[drafted, tokens]).clamp(max=1.0)
    draws = torch.rand(steps, generator=generator, device=generator.device).to(q.device)
    accepted = (draws < accept_prob).long().cumprod(dim=0).sum()
    q_at, p_at = q.index_select(0, accepted[None])[0], p.index_select(0, accepted[None])[0]
    residual = (q_at - p_at).clamp(min=0)
    mass = residual.sum()
    # after a rejection the bonus comes from the residual (q itself if the residual is empty); with every draft
    # accepted it comes from q at the last one
    rejected = (accepted < steps) & (mass > 0)
    bonus_probs = torch.where(rejected, residual / mass.clamp(min=torch.finfo(mass.dtype).tiny), q_at)
    return accepted, torch.multinomial(bonus_probs, 1, generator=generator)[0]


def accept_tree(tree: DraftTree, logits: torch.Tensor, params: SamplingParams, generator) -> tuple[list[int], int]:
    """Walk the tree from the root -> (accepted node indices, bonus token). logits[i]: target at node i."""
    path: list[int] = []
    node = 0
    target_argmax = logits.argmax(dim=-1).tolist() if params.temperature == 0 else None
    while True:
        children = tree.children(node)
        if target_argmax is not None:
            target_token = target_argmax[node]
            match = next((c for c in children if tree.tokens[c] == target_token), None)
            if match is None:
                return path, target_token
            path.append(match)
            node = match
            continue
        q = target_probs(logits[node], params.temperature, params.top_p)  # q: target prob
        for child in children:
            token, p = tree.tokens[child], tree.draft_probs[child]  # p: draft prob
            p_token = float(p[token]) if p is not None else 1.0
            if float(torch.rand((), generator=generator, device=generator.device)) < min(1.0, float(q[token]) / p_token):
                path.append(child)
                node = child
                break
            residual = torch.clamp(q - p, min=0) if p is not None else q.index_fill(0, torch.tensor(token, device=q.device), 0.0)
            if residual.sum() > 0:
                q = residual / residual.sum()
        else:
            return path, sample(q, generator)
