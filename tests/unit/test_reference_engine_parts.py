"""The reference engine's parts on hand-made tensors: the batched drafter cache, top-p, tree attention masks, chain
acceptance."""

from __future__ import annotations

from types import SimpleNamespace

import scipy.stats
import torch

from draftline.engines.base import SamplingParams
from draftline.engines.reference import acceptance
from draftline.engines.reference.drafts import ChainDrafts, DraftTree, tree_allowed
from draftline.engines.reference.kv_cache import DraftBatch


def test_draft_batch_equals_one_drafter_cache_per_sequence():
    """DraftBatch (slot = position, ragged rows, a shorter length instead of a crop) computes what the drafter's
    own forward computes with one DrafterKVCache per sequence."""
    from draftline.drafter.model import DrafterConfig, DrafterKVCache, Eagle3Drafter

    torch.manual_seed(0)
    config = DrafterConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
        draft_vocab_size=16, target_vocab_size=16, target_hidden_size=32, aux_layer_ids=(0, 1, 2),
    )  # fmt: skip
    drafter = Eagle3Drafter(config).eval()
    lengths, width = [5, 9], 9
    embeds, hidden = torch.randn(2, width, 32), torch.randn(2, width, 32)
    batch = DraftBatch()
    with torch.no_grad():
        logits, _ = batch.forward(drafter, embeds, hidden, torch.arange(width)[None].expand(2, -1))
        # row 0 keeps 3 entries (2 rejected), row 1 all 9; then two more tokens each, at their own positions
        more_embeds, more_hidden = torch.randn(2, 2, 32), torch.randn(2, 2, 32)
        kept = [3, 9]
        more_logits, _ = batch.forward(drafter, more_embeds, more_hidden, torch.tensor(kept)[:, None] + torch.arange(2))
        for row, (length, keep) in enumerate(zip(lengths, kept)):
            cache = DrafterKVCache()
            alone, _ = drafter(embeds[row : row + 1, :length], hidden[row : row + 1, :length], torch.arange(length), cache)
            torch.testing.assert_close(logits[row, :length], alone[0], atol=1e-5, rtol=1e-5)
            cache.crop(keep)
            alone, _ = drafter(more_embeds[row : row + 1], more_hidden[row : row + 1], torch.arange(keep, keep + 2), cache)
            torch.testing.assert_close(more_logits[row], alone[0], atol=1e-5, rtol=1e-5)



def test_target_probs_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = acceptance.target_probs(logits, temperature=1.0, top_p=0.8)
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)



def test_tree_allowed_sees_ancestors_and_self_and_padding_sees_itself():
    allowed = tree_allowed(torch.tensor([-1, 0, 0, 1, -1])).int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [0, 0, 0, 0, 1],
    ]


def ancestors_walk(parents: list[int], size: int) -> list[list[int]]:
    """The mask by walking up each node's parents, one element at a time."""
    allowed = [[int(i == j) for j in range(size)] for i in range(size)]
    for node in range(len(parents)):
        ancestor = parents[node]
        while ancestor != -1:
            allowed[node][ancestor] = 1
            ancestor = parents[ancestor]
    return allowed


def test_tree_allowed_of_a_batch_equals_walking_each_tree():
    generator = torch.Generator().manual_seed(0)
    trees = []
    for size in (1, 4, 7, 9):
        trees.append([-1] + [int(torch.randint(0, node, (), generator=generator)) for node in range(1, size)])
    width = max(len(tree) for tree in trees)
    parents = torch.tensor([tree + [-1] * (width - len(tree)) for tree in trees])
    masks = tree_allowed(parents).int().tolist()
    for tree, mask in zip(trees, masks):
        assert mask == ancestors_walk(tree, width)
    chain = tree_allowed(torch.arange(5) - 1)
    assert torch.equal(chain, torch.ones(5, 5, dtype=torch.bool).tril())


def sequence_stub(temperature: float, seed: int, top_p: float = 1.0):
    """What acceptance reads of a sequence: its params, whether it is greedy, its own generator."""
    params = SamplingParams(temperature=temperature, top_p=top_p)
    return SimpleNamespace(params=params, greedy=temperature == 0, generator=torch.Generator().manual_seed(seed))


def chain_tree(root: int, tokens: list[int], probs=None) -> DraftTree:
    return DraftTree([root] + tokens, list(range(-1, len(tokens))), [None] + (probs or [None] * len(tokens)))


def test_greedy_chain_acceptance_equals_walking_each_chain():
    """Every row at once with tensors: the longest prefix of drafts equal to the target's argmax, and the argmax
    after it, as the node-by-node walk finds them."""
    generator = torch.Generator().manual_seed(1)
    rows, steps, vocab = 64, 3, 5
    logits = torch.randn(rows, steps + 1, vocab, generator=generator)
    argmax = logits.argmax(dim=-1)
    # drafts that follow the argmax for a random number of steps, then a random token
    follow = torch.randint(0, steps + 1, (rows, 1), generator=generator)
    noise = torch.randint(0, vocab, (rows, steps), generator=generator)
    tokens = torch.where(torch.arange(steps)[None] < follow, argmax[:, :steps], noise)
    sequences = [sequence_stub(0.0, seed=row) for row in range(rows)]
    accepted, bonus = acceptance.accept_chains(ChainDrafts(tokens, [None] * rows), logits, sequences)
    assert len(set(accepted.tolist())) == steps + 1  # every accept length occurs
    for row in range(rows):
        path, expected_bonus = acceptance.accept_tree(chain_tree(0, tokens[row].tolist()), logits[row],
                                                      sequences[row].params, sequences[row].generator)  # fmt: skip
        assert (int(accepted[row]), int(bonus[row])) == (len(path), expected_bonus)


def test_sampled_chain_acceptance_follows_rejection_sampling():
    """(accept length, bonus) of a fixed 2-draft chain over many rows against its exact distribution: draft k is
    accepted with min(1, q_k(x)/p_k(x)) while every earlier one was; the bonus after a rejection at k is drawn
    from norm(max(0, q_k - p_k)), after the last draft from q_2."""
    rows, vocab = 4000, 4
    q_logits = torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.1, 0.4, 0.3, 0.2], [0.25, 0.25, 0.25, 0.25]]).log()
    p = torch.tensor([[0.2, 0.6, 0.1, 0.1], [0.3, 0.1, 0.5, 0.1]])
    tokens = torch.tensor([1, 2])  # accepted with 1/3, then 0.6: both residuals are drawn from
    q = acceptance.target_probs(q_logits, 1.0, 1.0)
    chance = (q[[0, 1], tokens] / p[[0, 1], tokens]).clamp(max=1)
    exact = torch.zeros(3, vocab)  # [accept length, bonus]
    reach = 1.0
    for k in range(2):
        residual = (q[k] - p[k]).clamp(min=0)
        exact[k] = reach * (1 - chance[k]) * residual / residual.sum()
        reach = reach * chance[k]
    exact[2] = reach * q[2]
    sequences = [sequence_stub(1.0, seed=row) for row in range(rows)]
    drafts = ChainDrafts(tokens[None].expand(rows, -1), [p] * rows)
    accepted, bonus = acceptance.accept_chains(drafts, q_logits[None].expand(rows, -1, -1), sequences)
    observed = torch.zeros(3 * vocab).index_add_(0, accepted * vocab + bonus, torch.ones(rows))
    expected = exact.flatten() * rows
    seen = expected > 0
    assert observed[~seen].sum() == 0, "a (length, bonus) pair that rejection sampling never produces"
    statistic = float(((observed[seen] - expected[seen]) ** 2 / expected[seen]).sum())
    p_value = float(scipy.stats.chi2.sf(statistic, int(seen.sum()) - 1))
    assert p_value > 1e-3, f"chain acceptance does not follow rejection sampling (p={p_value:.2e})"
