"""The reference engine's Engine protocol: load the target (and drafter), stream requests through the scheduler,
and one decode step: draft (proposer.py) -> verify (one batched target forward) -> accept (acceptance.py) -> extend.

Rows of the running caches are requests (scheduler.py): joining requests are prefilled together (one target forward
over their prompts, right-padded, each row causal over its own tokens, then one drafter extend) and a step drafts for
every row at once, then verifies all rows in one target forward: each row holds its chain or tree (root first)
padded to the widest, with its own positions and a mask that lets it see only its valid cache slots plus its
ancestors, within each layer's sliding window where the target has them (Gemma 3, gpt-oss: kv_cache.SlotGroup).
Targets whose HF cache is neither full attention nor a sliding window step one request at a time.
"""

from __future__ import annotations

import asyncio
import time
import warnings
from pathlib import Path
from typing import AsyncIterator, Optional

import torch
from transformers import DynamicCache

from draftline.config import DraftlineConfig, SpeculativeConfig
from draftline.drafter.export import load_drafter
from draftline.engines.base import TARGET_ONLY, GenerationChunk, SamplingParams, SpecStats
from draftline.engines.reference import acceptance, output
from draftline.engines.reference.checks import check_drafter_fits_target, check_request, check_speculative
from draftline.engines.reference.drafts import ChainDrafts, chain_verify_inputs, tree_verify_inputs
from draftline.engines.reference.kv_cache import Caches, TargetBatch, batchable_cache, target_forward
from draftline.engines.reference.proposer import EagleProposer
from draftline.engines.reference.scheduler import Request, Scheduler
from draftline.engines.reference.sequence import Sequence, new_sequence
from draftline.target.capture import drafter_token_embedding
from draftline.target.load import load_target


def new_phase_seconds() -> dict[str, float]:
    """prefill, draft (drafting + drafter extend), verify (the batched target forward), accept (acceptance, cache
    bookkeeping); "steps" counts decode steps. Overhead = wall time minus these."""
    return {"prefill": 0.0, "draft": 0.0, "verify": 0.0, "accept": 0.0, "steps": 0}


class ReferenceEngine:
    """Engine protocol over a local HF target and (optionally) an exported EAGLE-3 drafter."""

    name = "reference"

    def __init__(
        self,
        cfg: DraftlineConfig,
        target_dir: str | Path,
        drafter_dir: Optional[str | Path] = None,
        model_version: Optional[str] = None,
        speculative: Optional[SpeculativeConfig] = None,
    ) -> None:
        self.cfg = cfg
        self.target_dir = Path(target_dir)
        self.drafter_dir = Path(drafter_dir) if drafter_dir is not None else None
        self.model_version = model_version or (TARGET_ONLY if drafter_dir is None else str(self.drafter_dir))
        self.spec = speculative or cfg.engine.speculative
        self.device = torch.device(cfg.engine.device)
        self.model = self.tokenizer = self.drafter = self.proposer = None
        self.stop_token_ids: set[int] = set()
        self.max_positions = 0
        self.batchable: Optional[bool] = None  # whether the target's cache can hold many sequences (set by load)
        self.scheduler: Optional[Scheduler] = None
        self.phase_seconds = new_phase_seconds()  # time in each phase of decoding, for benchmarks/engines.py
        check_speculative(self.spec)

    # -------------------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        await asyncio.to_thread(self.load)

    def load(self) -> None:
        if self.device.type == "cpu" and self.cfg.engine.cpu_threads:
            torch.set_num_threads(self.cfg.engine.cpu_threads)
        target = load_target(self.cfg, device=str(self.device), target_dir=self.target_dir)
        self.model, self.tokenizer = target.model, target.tokenizer
        self.max_positions = int(self.model.config.max_position_embeddings)
        eos = self.model.generation_config.eos_token_id if self.model.generation_config is not None else None
        eos = eos if eos is not None else self.tokenizer.eos_token_id
        self.stop_token_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.batchable = self._probe_batchable()
        self.scheduler = Scheduler(self._advance, self.batchable)
        if self.drafter_dir is not None:
            self.drafter = load_drafter(self.drafter_dir, device=self.device)
            check_drafter_fits_target(self.drafter, self.model, self.drafter_dir)
            self.proposer = EagleProposer(
                self.drafter, drafter_token_embedding(self.model), self.spec, int(self.model.config.vocab_size), self.device
            )

    @torch.no_grad()
    def _probe_batchable(self) -> bool:
        cache = DynamicCache(config=self.model.config)
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        target_forward(self.model, ids, ids, cache, None)
        if batchable_cache(cache):
            return True
        warnings.warn(
            f"target {self.target_dir}: its KV cache layers ({sorted({type(layer).__name__ for layer in cache.layers})}) "
            "are neither full-attention nor sliding-window layers; the reference engine steps one request at a time "
            "(no batching)",
            stacklevel=2,
        )
        return False

    async def health(self) -> bool:
        return self.model is not None

    async def stop(self) -> None:
        self.model = self.drafter = self.proposer = None
        if self.scheduler is not None:
            self.scheduler.stop()

    # ------------------------------------------------------------------------------------------ generation

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        if self.model is None:
            raise RuntimeError("ReferenceEngine.generate before start(): await engine.start() first")
        check_request(prompt_ids, params, self.max_positions, int(self.model.config.vocab_size))
        sequence = new_sequence(prompt_ids, params, self.stop_token_ids, self.device)
        request = Request(sequence, asyncio.Queue(), output.IncrementalText(self.tokenizer))
        self.scheduler.submit(request)
        try:
            while True:
                chunk = await request.chunks.get()
                if isinstance(chunk, BaseException):
                    raise chunk
                yield chunk
                if chunk.finished:
                    return
        finally:
            request.cancelled = True  # a client that stops reading frees its row at the next step

    def _advance(self, running: list[Request], joining: list[Request], caches: Caches) -> list[tuple[Request, GenerationChunk]]:
        """One scheduler step: a decode step for `running` (rows 0.. of the caches), then one batched prefill for
        `joining` (their first token streams now; their rows join after the running ones and decode from the next
        step). Finished rows leave. A target whose cache cannot be batched steps each request alone, in its own
        one-row caches."""
        events = []
        if self.batchable:
            decoding = [(running, caches)] if running else []
            prefilling = [(joining, caches)] if joining else []
        else:
            decoding = [([request], request.caches) for request in running]
            prefilling = [([request], request.caches) for request in joining]
        with torch.no_grad():
            for requests, request_caches in decoding:
                committed = self._step_batch([r.sequence for r in requests], request_caches)
                chunks = [self._chunk(r, pending) for r, pending in zip(requests, committed)]
                request_caches.keep_rows([row for row, chunk in enumerate(chunks) if not chunk.finished])
                events += zip(requests, chunks)
            for requests, request_caches in prefilling:
                joined = self._prefill([r.sequence for r in requests])
                chunks = [self._chunk(r, r.sequence.tokens[r.sequence.prompt_length :]) for r in requests]
                joined.keep_rows([row for row, chunk in enumerate(chunks) if not chunk.finished])
                request_caches.add(joined)
                events += zip(requests, chunks)
        return events

    def _chunk(self, request: Request, pending: list[int]) -> GenerationChunk:
        return output.chunk(request.sequence, request.text, *self._cut(pending, request.sequence))

    def generate_ids(self, prompt_ids: list[int], params: SamplingParams) -> tuple[list[int], SpecStats]:
        """Synchronous whole-request generation, one sequence alone (tests, benchmarks): -> (output ids, stats)."""
        sequence = new_sequence(prompt_ids, params, self.stop_token_ids, self.device)
        with torch.no_grad():
            caches = self._prefill([sequence])
            pending = sequence.tokens[sequence.prompt_length :]
            while self._cut(pending, sequence)[1] is None:
                pending = self._step_batch([sequence], caches)[0]
        sequence.stats.output_tokens = len(sequence.tokens) - sequence.prompt_length
        return sequence.tokens[sequence.prompt_length :], sequence.stats

    def _cut(self, pending: list[int], sequence: Sequence):
        # the next step may write this many positions past the last committed token
        lookahead = 1 if self.drafter is None else self.spec.num_steps + 1
        return output.cut(pending, sequence, self.max_positions, lookahead)

    # ------------------------------------------------------------------------------------ prefill and step

    def _prefill(self, sequences: list[Sequence]) -> Caches:
        """One target forward over every prompt, right-padded to the longest (row b: causal over its own tokens);
        picks each first token; primes the drafter on each prompt. -> the new rows' caches."""
        started = time.perf_counter()
        lengths = [len(sequence.tokens) for sequence in sequences]
        width = max(lengths)
        ids = torch.zeros(len(sequences), width, dtype=torch.long)
        for row, sequence in enumerate(sequences):
            ids[row, : lengths[row]] = torch.tensor(sequence.tokens)
        in_prompt = torch.arange(width)[None] < torch.tensor(lengths)[:, None]  # [n, width]
        allowed = torch.ones(width, width, dtype=torch.bool).tril()[None] & in_prompt[:, None, :]  # key <= query, real
        positions = torch.arange(width)[None].expand(len(sequences), -1)
        caches = Caches(target=TargetBatch.empty(self.model.config, len(sequences), self.device))
        logits, aux = caches.target.forward(
            self.model, ids.to(self.device), positions.to(self.device), allowed.to(self.device), self._aux_layer_ids()
        )
        caches.target.commit(in_prompt)
        for row, sequence in enumerate(sequences):
            sequence.tokens.append(acceptance.pick(logits[row, lengths[row] - 1], sequence.params, sequence.generator))
        if self.proposer is not None:
            self.proposer.extend(sequences, caches.draft, aux, starts=[0] * len(sequences), counts=lengths)
        self.phase_seconds["prefill"] += time.perf_counter() - started
        return caches

    def _step_batch(self, sequences: list[Sequence], caches: Caches) -> list[list[int]]:
        """One decode step for every sequence (row i of `caches`) -> the tokens each committed (1 for target-only;
        accepted drafts + bonus otherwise). Drafting runs every row in each drafter forward; the verify of all rows
        is one target forward."""
        started = time.perf_counter()
        roots = [sequence.tokens[-1] for sequence in sequences]
        root_positions = [len(sequence.tokens) - 1 for sequence in sequences]
        if self.proposer is not None and self.spec.eagle_topk > 1:
            trees = self.proposer.propose_trees(sequences, caches.draft)
            drafted = time.perf_counter()
            ids, positions, allowed = (t.to(self.device) for t in tree_verify_inputs(trees, root_positions))
            logits, aux = caches.target.forward(self.model, ids, positions, allowed, self._aux_layer_ids())
            verified = time.perf_counter()
            committed, kept_aux = self._accept_trees(sequences, trees, logits, aux, caches)
        else:
            if self.proposer is None:  # the target alone: a chain of no drafts
                drafts = ChainDrafts(torch.zeros(len(sequences), 0, dtype=torch.long, device=self.device), [None] * len(sequences))
            else:
                drafts = self.proposer.propose_chains(sequences, caches.draft)
            drafted = time.perf_counter()
            ids, positions, allowed = chain_verify_inputs(roots, drafts, root_positions)
            logits, aux = caches.target.forward(self.model, ids, positions, allowed, self._aux_layer_ids())
            verified = time.perf_counter()
            committed, kept_aux = self._accept_chains(sequences, drafts, logits, aux, caches)
        starts = root_positions  # the drafter extends from each root's position
        for sequence, tokens in zip(sequences, committed):
            sequence.tokens.extend(tokens)
            if self.proposer is not None:
                sequence.stats.verify_steps += 1
                sequence.stats.accepted_draft_tokens += len(tokens) - 1
                sequence.pending_drafts = len(tokens) - 1
        caches.target.compact()
        accepted_at = time.perf_counter()
        if self.proposer is not None:
            self.proposer.extend(sequences, caches.draft, kept_aux, starts, counts=[len(tokens) for tokens in committed])
        phases = self.phase_seconds
        phases["draft"] += drafted - started + time.perf_counter() - accepted_at
        phases["verify"] += verified - drafted
        phases["accept"] += accepted_at - verified
        phases["steps"] += 1
        return committed

    def _accept_chains(self, sequences, drafts: ChainDrafts, logits, aux, caches: Caches):
        """-> (accepted drafts + bonus per row, the aux states of the root and accepted drafts [B, longest, ...]).
        One host sync for the whole batch."""
        accepted, bonus = acceptance.accept_chains(drafts, logits, sequences)
        kept = torch.arange(drafts.steps + 1, device=accepted.device)[None] <= accepted[:, None]  # root + accepted
        caches.target.commit(kept)
        counts, bonuses, draft_tokens = accepted.tolist(), bonus.tolist(), drafts.tokens.tolist()
        committed = [draft_tokens[row][:count] + [bonuses[row]] for row, count in enumerate(counts)]
        # a chain's kept nodes are a prefix: the drafter reads it, rows past their count are padding
        kept_aux = aux[:, : max(counts) + 1] if aux is not None else None
        return committed, kept_aux

    def _accept_trees(self, sequences, trees, logits, aux, caches: Caches):
        """Each row's tree walked on the host -> (accepted drafts + bonus per row, the aux states of the root and
        the accepted nodes, padded with the root's)."""
        kept_nodes, committed = [], []
        for row, (sequence, tree) in enumerate(zip(sequences, trees)):
            path, bonus = acceptance.accept_tree(tree, logits[row, : len(tree.tokens)], sequence.params, sequence.generator)
            kept_nodes.append([0] + path)  # the root and the accepted nodes become committed slots
            committed.append([tree.tokens[node] for node in path] + [bonus])
        kept = torch.zeros(logits.shape[:2], dtype=torch.bool)
        for row, nodes in enumerate(kept_nodes):
            kept[row, nodes] = True
        caches.target.commit(kept)
        longest = max(len(nodes) for nodes in kept_nodes)
        nodes = torch.tensor([nodes + [0] * (longest - len(nodes)) for nodes in kept_nodes], device=self.device)
        kept_aux = aux[torch.arange(len(sequences), device=self.device)[:, None], nodes] if aux is not None else None
        return committed, kept_aux

    def _aux_layer_ids(self) -> Optional[list[int]]:
        return list(self.drafter.config.aux_layer_ids) if self.drafter is not None else None
