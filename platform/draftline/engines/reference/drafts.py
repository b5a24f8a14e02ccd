"""What drafting hands to the verify: chains as tensors (every row the same length), trees as nodes; their masks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class ChainDrafts:
    """num_steps drafted tokens per row, each the child of the one before (topk 1). tokens [B, S] in the target
    vocab; draft_probs[b] [S, V_target]: the drafter distributions row b sampled from, None for a greedy row."""

    tokens: torch.Tensor
    draft_probs: list[Optional[torch.Tensor]]

    @property
    def steps(self) -> int:
        return self.tokens.shape[1]


def chain_verify_inputs(roots: list[int], drafts: ChainDrafts, root_positions: list[int]):
    """[root, drafts] per row, on the drafts' device -> (ids [B, S+1], positions [B, S+1], allowed [B, S+1, S+1]:
    causal)."""
    device = drafts.tokens.device
    ids = torch.cat([torch.tensor(roots, device=device)[:, None], drafts.tokens], dim=1)
    width = ids.shape[1]
    positions = torch.tensor(root_positions, device=device)[:, None] + torch.arange(width, device=device)[None]
    allowed = torch.ones(width, width, dtype=torch.bool, device=device).tril()[None].expand(len(roots), -1, -1)
    return ids, positions, allowed


@dataclass
class DraftTree:
    """Draft tokens in verify order; node 0 is the root (the last committed token), parents[0] == -1.

    draft_probs[i] is the drafter's distribution (over the target vocab) that node i was sampled from, or None
    when node i was picked deterministically (greedy or top-k): then p is one-hot at the token.
    """

    tokens: list[int]
    parents: list[int]
    draft_probs: list[Optional[torch.Tensor]]

    def children(self, node: int) -> list[int]:
        return [i for i, parent in enumerate(self.parents) if parent == node]

    def depths(self) -> list[int]:
        depth = [0] * len(self.tokens)
        for i in range(1, len(self.tokens)):
            depth[i] = depth[self.parents[i]] + 1
        return depth


def tree_allowed(parents: torch.Tensor) -> torch.Tensor:
    """parents [..., N] (-1: the root, or padding) -> [..., N, N] bool: node i sees its ancestors and itself.
    A chain is the causal mask; padding sees only itself."""
    size = parents.shape[-1]
    allowed = torch.eye(size, dtype=torch.bool, device=parents.device).expand(*parents.shape, size).clone()
    ancestor = parents
    for _ in range(size - 1):  # a path is at most size - 1 edges long
        has_ancestor = ancestor >= 0
        allowed |= torch.nn.functional.one_hot(ancestor.clamp(min=0), size).bool() & has_ancestor[..., None]
        ancestor = torch.where(has_ancestor, parents.gather(-1, ancestor.clamp(min=0)), ancestor)
    return allowed


def tree_verify_inputs(trees: list[DraftTree], root_positions: list[int]):
    """Every row's tree, root first, padded to the widest -> (ids [B, W], positions [B, W], allowed [B, W, W])."""
    width = max(len(tree.tokens) for tree in trees)
    ids = torch.zeros(len(trees), width, dtype=torch.long)
    depths = torch.zeros(len(trees), width, dtype=torch.long)  # padding sits at the root's position
    parents = torch.full((len(trees), width), -1, dtype=torch.long)
    for row, tree in enumerate(trees):
        size = len(tree.tokens)
        ids[row, :size] = torch.tensor(tree.tokens)
        depths[row, :size] = torch.tensor(tree.depths())
        parents[row, :size] = torch.tensor(tree.parents)
    return ids, torch.tensor(root_positions)[:, None] + depths, tree_allowed(parents)


def ancestors_and_self(node: int, parents: list[int]) -> set[int]:
    path = set()
    while node != -1:
        path.add(node)
        node = parents[node]
    return path


def select_tree(root_token: int, tokens: list[int], parents: list[int], scores: list[float], budget: int) -> DraftTree:
    """The `budget` best candidates (a node only with its parent), in candidate order so parents come first;
    siblings are ordered best first, which is the order rejection sampling tries them in."""
    by_score = sorted(range(len(tokens)), key=lambda c: (-scores[c], c))
    chosen: set[int] = set()
    for candidate in by_score:
        if len(chosen) == budget:
            break
        if parents[candidate] == -1 or parents[candidate] in chosen:
            chosen.add(candidate)
    order = sorted(chosen, key=lambda c: (len(ancestors_and_self(c, parents)), -scores[c], c))
    node_of = {candidate: i + 1 for i, candidate in enumerate(order)}
    return DraftTree(
        tokens=[root_token] + [tokens[c] for c in order],
        parents=[-1] + [0 if parents[c] == -1 else node_of[parents[c]] for c in order],
        draft_probs=[None] * (len(order) + 1),
    )
