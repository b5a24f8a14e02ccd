"""Drafting (vLLM's `EagleProposer`): the drafter's extend over newly verified positions, then a chain or SGLang's
top-k tree from its last output. Every drafter forward runs every row of the batch."""

from __future__ import annotations

import torch

from draftline.config import SpeculativeConfig
from draftline.drafter.model import attend
from draftline.engines.reference.drafts import ChainDrafts, DraftTree, select_tree
from draftline.engines.reference.kv_cache import DraftBatch
from draftline.engines.reference.sequence import Sequence


def draft_probs_in_target_vocab(drafter, draft_logits: torch.Tensor, temperature: float, target_vocab_size: int):
    """Drafter distribution mapped onto the target vocabulary (zero outside the draft vocab)."""
    probs = torch.softmax(draft_logits.float() / temperature, dim=-1)
    full = probs.new_zeros(target_vocab_size)
    return full.index_copy(0, drafter.draft_to_target(torch.arange(probs.shape[-1], device=probs.device)), probs)


class EagleProposer:
    def __init__(self, drafter, target_embedding, spec: SpeculativeConfig, target_vocab_size: int, device) -> None:
        self.drafter = drafter
        self.target_embedding = target_embedding  # the frozen target's input embedding: the drafter has none
        self.spec = spec
        self.target_vocab_size = target_vocab_size
        self.device = device

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Target embeddings of token ids [B, T] -> [B, T, H] in the drafter's dtype."""
        return self.target_embedding(token_ids.to(self.device)).to(self.drafter.fc.weight.dtype)

    def extend(
        self, sequences: list[Sequence], drafts: DraftBatch, aux: torch.Tensor, starts: list[int], counts: list[int]
    ) -> None:
        """Drafter over newly verified positions start..start+count-1 of every row, one forward: the target's aux
        states there (aux [B, T, n_aux*H], padded past count) and the embeddings of the tokens after them. They
        become the rows' committed drafter entries; each row's output at its last one drafts its next round."""
        drafter = self.drafter
        width = aux.shape[1]
        next_tokens = torch.zeros(len(sequences), width, dtype=torch.long)
        for row, (sequence, start, count) in enumerate(zip(sequences, starts, counts)):
            next_tokens[row, :count] = torch.tensor(sequence.tokens[start + 1 : start + 1 + count])
        # padded entries take the positions after a row's count: their slots are rewritten before anything reads them
        positions = (torch.tensor(starts)[:, None] + torch.arange(width)[None]).to(self.device)
        hidden = drafter.fuse_aux(aux.to(drafter.fc.weight.dtype))
        logits, hidden_out = drafts.forward(drafter, self.embed(next_tokens), hidden, positions)
        rows, last = torch.arange(len(sequences), device=self.device), torch.tensor(counts, device=self.device) - 1
        drafts.logits, drafts.hidden = logits[rows, last], hidden_out[rows, last]
        drafts.lengths = [start + count for start, count in zip(starts, counts)]

    def propose_chains(self, sequences: list[Sequence], drafts: DraftBatch) -> ChainDrafts:
        """num_steps tokens per row, each fed back into the drafter: one drafter forward over every row per step.
        Depth d's entry lands at position (= slot) L-2+d, after the row's committed entries 0..L-2. Greedy rows
        take the drafter's argmax, sampled rows draw from it with their own generator; tokens stay on the device."""
        drafter, steps = self.drafter, self.spec.num_steps
        logits, hidden = drafts.logits, drafts.hidden  # [B, Vd], [B, H]: the drafter at position L-2 predicts x_L
        first_position = torch.tensor([len(sequence.tokens) - 1 for sequence in sequences], device=self.device)
        sampled = [row for row, sequence in enumerate(sequences) if not sequence.greedy]
        draft_probs: list = [[] if row in sampled else None for row in range(len(sequences))]
        chain = []
        for depth in range(1, steps + 1):
            tokens = drafter.draft_to_target(logits.argmax(dim=-1))  # [B]
            for row in sampled:
                sequence = sequences[row]
                probs = draft_probs_in_target_vocab(drafter, logits[row], sequence.params.temperature, self.target_vocab_size)
                tokens[row] = torch.multinomial(probs, 1, generator=sequence.generator)[0]
                draft_probs[row].append(probs)
            chain.append(tokens)
            if depth == steps:
                break
            positions = (first_position + depth - 1)[:, None]
            step_logits, step_hidden = drafts.forward(drafter, self.embed(tokens[:, None]), hidden[:, None], positions)
            logits, hidden = step_logits[:, 0], step_hidden[:, 0]
        return ChainDrafts(torch.stack(chain, dim=1), [None if p is None else torch.stack(p) for p in draft_probs])

    def propose_trees(self, sequences: list[Sequence], drafts: DraftBatch) -> list[DraftTree]:
        """SGLang's EAGLE tree for every row at once: each step expands the topk best paths (by summed draft
        log-prob) by their topk next tokens, one drafter forward over the [B, topk] frontier; the
        num_draft_tokens-1 best nodes over all steps form the tree the target verifies. Tree nodes' keys stay
        out of the drafter cache: several nodes share a position.

        Candidates are numbered as they are made: the root's topk children first, then per step each frontier
        node's topk children in frontier order. Everything stays a tensor until the tree is selected."""
        drafter, topk, layer, batch = self.drafter, self.spec.eagle_topk, self.drafter.midlayer, len(sequences)
        lengths = torch.tensor(drafts.lengths, device=self.device)
        cached = max(drafts.lengths)
        sees_cache = (torch.arange(cached, device=self.device)[None] < lengths[:, None])[:, None].expand(-1, topk, -1)
        root_positions = lengths - 1  # the drafter position of each root's last extend entry
        frontier_scores, top_ids = torch.log_softmax(drafts.logits.float(), dim=-1).topk(topk, dim=-1)  # [B, topk]
        frontier_tokens = drafter.draft_to_target(top_ids)
        frontier = torch.arange(topk, device=self.device)[None].expand(batch, -1)  # candidate ids [B, topk]
        tokens, parents, scores = [frontier_tokens], [torch.full_like(frontier, -1)], [frontier_scores]
        frontier_hidden = drafts.hidden[:, None].expand(-1, topk, -1)  # [B, topk, H]: what each frontier node is fed
        # paths[b, i, j]: expanded node j (in the order they were expanded) is frontier node i or one of its ancestors
        paths = torch.zeros(batch, topk, 0, dtype=torch.bool, device=self.device)
        itself = torch.eye(topk, dtype=torch.bool, device=self.device).expand(batch, -1, -1)
        tree_keys = tree_values = None
        for step in range(1, self.spec.num_steps):
            positions = (root_positions + step)[:, None].expand(-1, topk)
            q, k, v = layer.project_qkv(self.embed(frontier_tokens), frontier_hidden, positions)
            tree_keys = k if tree_keys is None else torch.cat([tree_keys, k], dim=2)
            tree_values = v if tree_values is None else torch.cat([tree_values, v], dim=2)
            paths = torch.cat([paths, itself], dim=-1)
            allowed = torch.cat([sees_cache, paths], dim=-1)  # its row's committed entries and its own ancestors
            keys = torch.cat([drafts.keys[:, :, :cached], tree_keys], dim=2)
            values = torch.cat([drafts.values[:, :, :cached], tree_values], dim=2)
            hidden_out = layer.finish(attend(q, keys, values, allowed[:, None]), residual=frontier_hidden)
            step_log_probs = torch.log_softmax(drafter.logits(hidden_out).float(), dim=-1)  # [B, topk, Vd]
            child_scores, child_ids = step_log_probs.topk(topk, dim=-1)  # [B, topk parents, topk children]
            child_scores = (child_scores + frontier_scores[..., None]).flatten(1)  # path log-prob
            child_tokens = drafter.draft_to_target(child_ids).flatten(1)
            best = child_scores.topk(topk, dim=-1).indices  # [B, topk] over parent*topk + child
            first_child = sum(t.shape[1] for t in tokens)
            tokens.append(child_tokens)
            parents.append(frontier.repeat_interleave(topk, dim=1))
            scores.append(child_scores)
            frontier = first_child + best
            frontier_tokens, frontier_scores = child_tokens.gather(1, best), child_scores.gather(1, best)
            parent_rows = torch.arange(batch, device=self.device)[:, None]
            frontier_hidden = hidden_out[parent_rows, best // topk]
            paths = paths[parent_rows, best // topk]
        budget = self.spec.num_draft_tokens - 1
        tokens, parents, scores = (torch.cat(t, dim=1).tolist() for t in (tokens, parents, scores))
        return [select_tree(s.tokens[-1], tokens[b], parents[b], scores[b], budget) for b, s in enumerate(sequences)]
