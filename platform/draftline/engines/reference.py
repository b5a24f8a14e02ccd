"""The reference engine: EAGLE-3 speculative decoding in plain PyTorch over the HF target (CPU or GPU).

Written like gpt-fast's generate.py: one request is a `Sequence`; one `step` drafts, verifies and accepts.
SGLang's parameters mean the same here:
  num_steps         draft depth (drafter forwards per round, the first one shared with the draft extend)
  eagle_topk        1: a chain of num_steps tokens; >1: a tree, each step keeps the topk best partial paths
  num_draft_tokens  tree: tokens the target verifies per round, the root (last accepted token) included;
                    chain: always num_steps + 1 (SGLang forces the same)

Positions. Committed tokens are x_0..x_{L-1}; the target KV cache holds positions 0..L-2 and x_{L-1} (the last
bonus token) is the root of the next verify. The drafter at position t reads (target aux states at t, embedding
of x_{t+1}) and predicts x_{t+2} (drafter/ttt.py); its KV cache holds one entry per position 0..L-2. A round:
  1. draft: from the drafter's last output (position L-2) draft a chain/tree of tokens for positions L..
  2. verify: one target forward over [x_{L-1}, drafts] (tree attention mask for a tree), capturing aux states
  3. accept: walk the tree from the root (greedy: match the target argmax; sampling: rejection sampling),
     plus one bonus token from the target's distribution at the last accepted node
  4. keep the target cache entries of the root and the accepted path; run the drafter over those positions
     (its "extend"), which also yields the logits of the next round's first draft.
Accept length = tokens emitted per verify step, bonus included (SGLang's spec accept length).

Losslessness. Greedy: every emitted token is the target's argmax given the committed prefix, so the output is
the target's own greedy output (up to float reordering in batched vs single-token forwards). Sampling: at a node
with target distribution q, each child x with draft distribution p is accepted with probability min(1, q(x)/p(x));
on rejection q <- norm(max(0, q - p)) and the next child is tried; if no child is accepted the bonus is sampled
from q. Chains sample their drafts from the drafter (p = draft probabilities); trees pick the drafter's top-k
deterministically, so p is one-hot at the draft (accept with q(x), remove x from q on rejection). Either way each
emitted token is distributed exactly as the target's q.

Continuous batching: one scheduler loop (`_schedule`) owns the model. Between steps, new requests join
(prefill alone, then their KV cache becomes a row of the running `TargetBatch`) and finished or cancelled ones
leave. A step drafts for each running request, then verifies all of them in one target forward: each row holds
its tree (root first) padded to the widest, with its own positions and a mask that lets it see only its valid
cache slots plus its ancestors. Rejected drafts' slots stay masked instead of being cropped; the batch compacts
when a column is unused by every row. Each request keeps its own sampling generator, so a seeded request draws
the same tokens at any concurrency. Targets whose HF cache is not plain full attention step one request at a time.
"""

from __future__ import annotations

import asyncio
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Optional

import torch

from draftline.config import DraftlineConfig, SpeculativeConfig
from draftline.engines.base import TARGET_ONLY, GenerationChunk, SamplingParams, SpecStats
from draftline.target.aux_layers import capture_id_problems


def new_phase_seconds() -> dict[str, float]:
    """prefill, draft (drafting + drafter extend), verify (the batched target forward), accept (acceptance, cache
    bookkeeping); "steps" counts decode steps. Overhead = wall time minus these."""
    return {"prefill": 0.0, "draft": 0.0, "verify": 0.0, "accept": 0.0, "steps": 0}


# ---------------------------------------------------------------------------------------------- probabilities


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


# ------------------------------------------------------------------------------------------------ target side


@torch.no_grad()
def target_forward(
    model,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cache,
    aux_layer_ids: Optional[list[int]],
    attention_mask: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Target forward with KV cache -> (logits [B, T, V], aux states [B, T, n_aux*H] or None).

    The aux states are exactly what `draftline.target.capture.capture_aux_hidden` feeds the drafter
    (`hidden_states[i + 1]` per aux layer id i, concatenated in order); tests pin the two together.
    """
    outputs = model.base_model(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=aux_layer_ids is not None,
        return_dict=True,
    )
    logits = model.lm_head(outputs.last_hidden_state)
    aux = None
    if aux_layer_ids is not None:
        aux = torch.cat([outputs.hidden_states[layer_id + 1] for layer_id in aux_layer_ids], dim=-1)
    return logits, aux


def tree_allowed(parents: list[int], size: int, device) -> torch.Tensor:
    """[size, size] bool: node i sees its ancestors and itself (node 0 is the root, parents[0] == -1).
    A chain is the causal mask. Rows past len(parents) are padding and see only themselves."""
    allowed = torch.eye(size, dtype=torch.bool, device=device)
    for node in range(len(parents)):
        ancestor = parents[node]
        while ancestor != -1:
            allowed[node, ancestor] = True
            ancestor = parents[ancestor]
    return allowed


def batchable_cache(cache) -> bool:
    """Whether the HF cache is made of plain full-attention key/value layers [B, heads, S, D] (Llama, Qwen3, MoE,
    MLA as transformers implements them): those can share one batched cache with a slot-validity mask.
    Anything else (sliding-window or linear-attention layers) runs one sequence per batch."""
    from transformers.cache_utils import DynamicLayer

    return all(type(layer) is DynamicLayer for layer in getattr(cache, "layers", [None]))


class TargetBatch:
    """The target KV cache of running sequences: one HF DynamicCache, one row per sequence, and `valid` [B, S]
    marking which slots hold committed tokens. A verify appends T slots to every row; the slots of rejected
    drafts stay invalid (masked) instead of being cropped, and `compact` packs every row's valid slots to the
    left once a column is unused by every row. Positions are per row (RoPE is applied before caching), so a
    slot's index need not equal its position."""

    def __init__(self) -> None:
        self.cache = None
        self.valid: Optional[torch.Tensor] = None  # [B, S] bool

    @property
    def rows(self) -> int:
        return 0 if self.valid is None else self.valid.shape[0]

    def add(self, cache) -> None:
        """Append a prefilled single-sequence cache (every slot valid) as the last row."""
        length = cache.layers[0].keys.shape[2]
        valid = torch.ones(1, length, dtype=torch.bool, device=cache.layers[0].keys.device)
        if self.cache is None:
            self.cache, self.valid = cache, valid
            return
        width = max(self.valid.shape[1], length)
        for mine, theirs in zip(self.cache.layers, cache.layers):
            mine.keys = torch.cat([_pad_slots(mine.keys, width), _pad_slots(theirs.keys, width)])
            mine.values = torch.cat([_pad_slots(mine.values, width), _pad_slots(theirs.values, width)])
        self.valid = torch.cat([_pad_slots(self.valid, width), _pad_slots(valid, width)])

    def keep_rows(self, rows: list[int]) -> None:
        if not rows:
            self.cache = self.valid = None
            return
        index = torch.tensor(rows, device=self.valid.device)
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)
        self.valid = self.valid.index_select(0, index)

    def forward(self, model, ids, positions, new_allowed, aux_layer_ids):
        """Every row's new tokens [B, T] in one forward; row b sees its valid slots and new_allowed[b] [T, T]."""
        batch, length = ids.shape
        allowed = torch.cat([self.valid[:, None, :].expand(batch, length, -1), new_allowed], dim=-1)
        dtype = model.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=ids.device).masked_fill(~allowed, torch.finfo(dtype).min)
        logits, aux = target_forward(model, ids, positions, self.cache, aux_layer_ids, mask[:, None])
        self.valid = torch.cat([self.valid, torch.zeros(batch, length, dtype=torch.bool, device=ids.device)], dim=1)
        return logits, aux

    def commit(self, row: int, new_slots: list[int], num_new: int) -> None:
        """Mark slots of the last forward (indices into its T new tokens) as committed for `row`."""
        first = self.valid.shape[1] - num_new
        self.valid[row, [first + i for i in new_slots]] = True

    def compact(self) -> None:
        counts = self.valid.sum(dim=1)
        width = int(counts.max())
        if width == self.valid.shape[1]:
            return
        # stable sort puts each row's valid slots first, in slot order
        order = torch.sort((~self.valid).to(torch.int8), dim=1, stable=True).indices[:, :width]
        for layer in self.cache.layers:
            index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys = layer.keys.gather(2, index)
            index = order[:, None, :, None].expand(-1, layer.values.shape[1], -1, layer.values.shape[3])
            layer.values = layer.values.gather(2, index)
        self.valid = torch.arange(width, device=counts.device)[None] < counts[:, None]


def _pad_slots(x: torch.Tensor, width: int) -> torch.Tensor:
    """Pad dim 2 (keys/values [B, heads, S, D]) or dim 1 (valid [B, S]) with zeros/False up to width."""
    dim = 2 if x.dim() == 4 else 1
    missing = width - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


# ----------------------------------------------------------------------------------------------- draft side


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


def draft_probs_in_target_vocab(drafter, draft_logits: torch.Tensor, temperature: float, target_vocab_size: int):
    """Drafter distribution mapped onto the target vocabulary (zero outside the draft vocab)."""
    probs = torch.softmax(draft_logits.float() / temperature, dim=-1)
    full = probs.new_zeros(target_vocab_size)
    return full.index_copy(0, drafter.draft_to_target(torch.arange(probs.shape[-1], device=probs.device)), probs)


# ------------------------------------------------------------------------------------------------- a request


@dataclass
class Sequence:
    """One request's decoding state; its target KV lives in a row of the running TargetBatch."""

    tokens: list[int]  # prompt + emitted
    prompt_length: int
    params: SamplingParams
    stop_ids: set[int]
    generator: torch.Generator
    draft_cache: object = None  # DrafterKVCache
    draft_logits: Optional[torch.Tensor] = None  # [Vd] drafter logits at position L-2 (predicts x_L)
    draft_hidden: Optional[torch.Tensor] = None  # [H] drafter hidden_out at position L-2
    pending_drafts: int = 0  # how many of the newest committed tokens are accepted drafts (the rest: bonus/prefill)
    stats: SpecStats = field(default_factory=SpecStats)


@dataclass
class _Request:
    """A request inside the scheduler: its sequence and the queue its chunks stream through."""

    sequence: Sequence
    chunks: asyncio.Queue
    text: "_IncrementalText"
    cancelled: bool = False
    batch: "TargetBatch" = field(default_factory=lambda: TargetBatch())  # own row, only for an unbatchable target


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
        self.model = self.tokenizer = self.drafter = None
        self.stop_token_ids: set[int] = set()
        self.max_positions = 0
        self.batchable: Optional[bool] = None  # whether the target's cache can hold many sequences (first prefill)
        self._batch = TargetBatch()  # the running requests' target KV, one row each
        self._waiting: list[_Request] = []
        self._running: list[_Request] = []  # in TargetBatch row order
        self._wake = asyncio.Event()
        self._scheduler: Optional[asyncio.Task] = None
        self.phase_seconds = new_phase_seconds()  # time in each phase of decoding, for benchmarks/engines.py
        _check_speculative(self.spec)

    # -------------------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        await asyncio.to_thread(self.load)

    def load(self) -> None:
        from draftline.target.load import load_target

        if self.device.type == "cpu" and self.cfg.engine.cpu_threads:
            torch.set_num_threads(self.cfg.engine.cpu_threads)
        target = load_target(self.cfg, device=str(self.device), target_dir=self.target_dir)
        self.model, self.tokenizer = target.model, target.tokenizer
        self.max_positions = int(self.model.config.max_position_embeddings)
        eos = self.model.generation_config.eos_token_id if self.model.generation_config is not None else None
        eos = eos if eos is not None else self.tokenizer.eos_token_id
        self.stop_token_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.batchable = self._probe_batchable()
        if self.drafter_dir is not None:
            from draftline.drafter.export import load_drafter

            self.drafter = load_drafter(self.drafter_dir, device=self.device)
            _check_drafter_fits_target(self.drafter, self.model, self.drafter_dir)

    @torch.no_grad()
    def _probe_batchable(self) -> bool:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        target_forward(self.model, ids, ids, cache, None)
        if batchable_cache(cache):
            return True
        warnings.warn(
            f"target {self.target_dir}: its KV cache layers ({sorted({type(layer).__name__ for layer in cache.layers})}) "
            "are not plain full-attention layers; the reference engine steps one request at a time (no batching)",
            stacklevel=2,
        )
        return False

    async def health(self) -> bool:
        return self.model is not None

    async def stop(self) -> None:
        self.model = self.drafter = None
        for request in self._running + self._waiting:
            request.chunks.put_nowait(RuntimeError("the engine stopped before the request finished"))
        self._running, self._waiting = [], []
        if self._scheduler is not None:
            self._scheduler.cancel()
            self._scheduler = None
        self._batch = TargetBatch()

    # ------------------------------------------------------------------------------------------ generation

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[GenerationChunk]:
        if self.model is None:
            raise RuntimeError("ReferenceEngine.generate before start(): await engine.start() first")
        _check_request(prompt_ids, params, self.max_positions, int(self.model.config.vocab_size))
        request = _Request(self._new_sequence(prompt_ids, params), asyncio.Queue(), _IncrementalText(self.tokenizer))
        self._waiting.append(request)
        if self._scheduler is None or self._scheduler.done():
            # one scheduler per event loop (asyncio.run in tests and benchmarks makes a new loop each time); rows
            # of requests left behind by an earlier loop are dropped with it
            self._wake = asyncio.Event()
            self._running, self._batch = [], TargetBatch()
            self._scheduler = asyncio.get_running_loop().create_task(self._schedule())
        self._wake.set()
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

    async def _schedule(self) -> None:
        """The scheduler loop: between steps, waiting requests join (prefill) and finished or cancelled ones
        leave; each step advances every running request with one batched target forward (in a worker thread,
        so the event loop keeps streaming)."""
        while self.model is not None:
            live = [row for row, request in enumerate(self._running) if not request.cancelled]
            if len(live) < len(self._running):
                if self.batchable:
                    self._batch.keep_rows(live)
                self._running = [self._running[row] for row in live]
            joining, self._waiting = [r for r in self._waiting if not r.cancelled], []
            if not self._running and not joining:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                events = await asyncio.to_thread(self._advance, self._running, joining)
            except Exception as err:  # noqa: BLE001 - every waiting client gets the error, the loop keeps serving
                for request in self._running + joining:
                    request.chunks.put_nowait(err)
                self._running, self._batch = [], TargetBatch()
                continue
            for request, chunk in events:
                request.chunks.put_nowait(chunk)
            finished = {id(request) for request, chunk in events if chunk.finished}
            self._running = [r for r in self._running + joining if id(r) not in finished]

    def _advance(self, running: list["_Request"], joining: list["_Request"]) -> list[tuple["_Request", GenerationChunk]]:
        """One scheduler step: a decode step for `running` (rows 0.. of the batch), then prefill for `joining`
        (their first token streams now; they decode from the next step). Finished rows leave the batch.
        A target whose cache cannot be batched steps each request alone, in its own one-row batch."""
        events = []
        with torch.no_grad():
            if running and self.batchable:
                committed = self._step_batch([r.sequence for r in running], self._batch)
                events += [(r, self._chunk(r, pending)) for r, pending in zip(running, committed)]
                self._batch.keep_rows([row for row, (_, chunk) in enumerate(events) if not chunk.finished])
            for request in running if not self.batchable else []:
                events.append((request, self._chunk(request, self._step_batch([request.sequence], request.batch)[0])))
            for request in joining:
                batch = self._batch if self.batchable else request.batch
                self._prefill(request.sequence, batch)
                chunk = self._chunk(request, request.sequence.tokens[request.sequence.prompt_length :])
                if chunk.finished:
                    batch.keep_rows(list(range(batch.rows - 1)))
                events.append((request, chunk))
        return events

    def _chunk(self, request: "_Request", pending: list[int]) -> GenerationChunk:
        sequence = request.sequence
        emitted, finish_reason = self._cut(pending, sequence)
        finished = finish_reason is not None
        if finished:
            sequence.stats.output_tokens = len(sequence.tokens) - sequence.prompt_length
        return GenerationChunk(
            token_ids=emitted,
            text=request.text.push(emitted, final=finished),
            finished=finished,
            finish_reason=finish_reason,
            stats=SpecStats(**vars(sequence.stats)) if finished else None,
        )

    def generate_ids(self, prompt_ids: list[int], params: SamplingParams) -> tuple[list[int], SpecStats]:
        """Synchronous whole-request generation, one sequence alone (tests, benchmarks): -> (output ids, stats)."""
        sequence = self._new_sequence(prompt_ids, params)
        batch = TargetBatch()
        with torch.no_grad():
            self._prefill(sequence, batch)
            pending = sequence.tokens[sequence.prompt_length :]
            while self._cut(pending, sequence)[1] is None:
                pending = self._step_batch([sequence], batch)[0]
        sequence.stats.output_tokens = len(sequence.tokens) - sequence.prompt_length
        return sequence.tokens[sequence.prompt_length :], sequence.stats

    def _new_sequence(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        generator = torch.Generator(device=self.device)
        generator.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, ())))
        stop_ids = self.stop_token_ids | set(params.stop_token_ids)
        return Sequence(list(prompt_ids), len(prompt_ids), params, stop_ids, generator)

    def _prefill(self, sequence: Sequence, batch: TargetBatch) -> None:
        """Target forward over the prompt (its own cache, then a new row of `batch`); emits the first token;
        primes the drafter on the prompt."""
        from transformers import DynamicCache

        started = time.perf_counter()
        prompt = sequence.tokens
        cache = DynamicCache(config=self.model.config)
        ids = torch.tensor([prompt], device=self.device)
        positions = torch.arange(len(prompt), device=self.device)[None]
        logits, aux = target_forward(self.model, ids, positions, cache, self._aux_layer_ids())
        sequence.tokens.append(self._pick(logits[0, -1], sequence.params, sequence.generator))
        batch.add(cache)
        if self.drafter is not None:
            from draftline.drafter.model import DrafterKVCache

            sequence.draft_cache = DrafterKVCache()
            self._draft_extend(sequence, aux[0], start_position=0)
        self.phase_seconds["prefill"] += time.perf_counter() - started

    def _step_batch(self, sequences: list[Sequence], batch: TargetBatch) -> list[list[int]]:
        """One decode step for every sequence (row i of `batch`) -> the tokens each
        committed (1 for target-only; accepted drafts + bonus otherwise). Drafting is per sequence; the verify
        of all rows is one target forward: row b holds its tree (root first), padded to the widest tree."""
        started = time.perf_counter()
        if self.drafter is None:
            trees = [DraftTree([s.tokens[-1]], [-1], [None]) for s in sequences]
        else:
            trees = [self._draft(s, s.params) for s in sequences]
        drafted = time.perf_counter()
        width = max(len(tree.tokens) for tree in trees)
        ids = torch.zeros(len(trees), width, dtype=torch.long)
        positions = torch.zeros(len(trees), width, dtype=torch.long)
        allowed = torch.zeros(len(trees), width, width, dtype=torch.bool)
        for row, (sequence, tree) in enumerate(zip(sequences, trees)):
            size = len(tree.tokens)
            ids[row, :size] = torch.tensor(tree.tokens)
            root_position = len(sequence.tokens) - 1
            positions[row] = root_position
            positions[row, :size] = root_position + torch.tensor(tree.depths())
            allowed[row] = tree_allowed(tree.parents, width, "cpu")
        logits, aux = batch.forward(
            self.model, ids.to(self.device), positions.to(self.device), allowed.to(self.device), self._aux_layer_ids()
        )
        verified = time.perf_counter()
        extend_s = 0.0
        committed = []
        for row, (sequence, tree) in enumerate(zip(sequences, trees)):
            path, bonus = _accept(tree, logits[row, : len(tree.tokens)], sequence.params, sequence.generator)
            kept = [0] + path  # the root and the accepted nodes become committed slots
            batch.commit(row, kept, width)
            accepted = [tree.tokens[node] for node in path]
            past_length = len(sequence.tokens) - 1
            sequence.tokens.extend(accepted + [bonus])
            if self.drafter is not None:
                sequence.stats.verify_steps += 1
                sequence.stats.accepted_draft_tokens += len(accepted)
                sequence.pending_drafts = len(accepted)
                sequence.draft_cache.crop(past_length)
                extend_started = time.perf_counter()
                self._draft_extend(sequence, aux[row, kept], start_position=past_length)
                extend_s += time.perf_counter() - extend_started
            committed.append(accepted + [bonus])
        batch.compact()
        phases = self.phase_seconds
        phases["draft"] += drafted - started + extend_s
        phases["verify"] += verified - drafted
        phases["accept"] += time.perf_counter() - verified - extend_s
        phases["steps"] += 1
        return committed

    # ---------------------------------------------------------------------------------------------- pieces

    def _cut(self, pending: list[int], sequence: Sequence):
        # the next step may write this many positions past the last committed token
        lookahead = 1 if self.drafter is None else self.spec.num_steps + 1
        return _truncate(pending, sequence, sequence.params.max_new_tokens, sequence.stop_ids, self.max_positions, lookahead)

    def _aux_layer_ids(self) -> Optional[list[int]]:
        return list(self.drafter.config.aux_layer_ids) if self.drafter is not None else None

    def _pick(self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
        if params.temperature == 0:
            return int(logits.argmax())
        return sample(target_probs(logits, params.temperature, params.top_p), generator)

    def _embed(self, token_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor([token_ids], device=self.device)
        return self.model.get_input_embeddings()(ids).to(self.drafter.fc.weight.dtype)

    def _draft_extend(self, sequence: Sequence, aux: torch.Tensor, start_position: int) -> None:
        """Drafter over newly verified positions start..start+m-1 (aux states there, embeddings of the tokens
        after them); appends them to the drafter cache and keeps the last position's output for drafting."""
        drafter = self.drafter
        length = aux.shape[0]
        next_tokens = sequence.tokens[start_position + 1 : start_position + 1 + length]
        hidden = drafter.fuse_aux(aux[None].to(drafter.fc.weight.dtype))
        positions = torch.arange(start_position, start_position + length, device=self.device)
        logits, hidden_out = drafter(self._embed(next_tokens), hidden, positions, cache=sequence.draft_cache)
        sequence.draft_logits, sequence.draft_hidden = logits[0, -1], hidden_out[0, -1]

    def _draft(self, sequence: Sequence, params: SamplingParams) -> DraftTree:
        if self.spec.eagle_topk == 1:
            return self._draft_chain(sequence, params)
        return self._draft_tree(sequence)

    def _draft_chain(self, sequence: Sequence, params: SamplingParams) -> DraftTree:
        """num_steps tokens, each fed back into the drafter (its cache grows by num_steps-1 chain entries)."""
        drafter, greedy = self.drafter, params.temperature == 0
        tree = DraftTree([sequence.tokens[-1]], [-1], [None])
        logits, hidden = sequence.draft_logits, sequence.draft_hidden
        position = len(sequence.tokens) - 1  # RoPE position of the first chain entry (depth 1)
        for depth in range(1, self.spec.num_steps + 1):
            if greedy:
                token, probs = int(drafter.draft_to_target(logits.argmax())), None
            else:
                probs = draft_probs_in_target_vocab(drafter, logits, params.temperature, self.model.config.vocab_size)
                token = sample(probs, sequence.generator)
            tree.tokens.append(token)
            tree.parents.append(depth - 1)
            tree.draft_probs.append(probs)
            if depth == self.spec.num_steps:
                break
            step_position = torch.tensor([position + depth - 1], device=self.device)
            step_logits, step_hidden = drafter(
                self._embed([token]), hidden[None, None], step_position, cache=sequence.draft_cache
            )
            logits, hidden = step_logits[0, -1], step_hidden[0, -1]
        return tree

    def _draft_tree(self, sequence: Sequence) -> DraftTree:
        """SGLang's EAGLE tree: each step expands the topk best paths (by summed draft log-prob) by their topk
        next tokens; the num_draft_tokens-1 best nodes over all steps form the tree the target verifies."""
        from draftline.drafter.model import attend

        drafter, topk, layer = self.drafter, self.spec.eagle_topk, self.drafter.midlayer
        root_position = len(sequence.tokens) - 2  # drafter position of the root's last extend entry
        # candidate nodes: target token, parent candidate (-1 = root), cumulative log-prob
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        log_probs = torch.log_softmax(sequence.draft_logits.float(), dim=-1)
        top_scores, top_ids = log_probs.topk(topk)
        frontier = list(range(topk))
        for score, draft_id in zip(top_scores.tolist(), top_ids.tolist()):
            tokens.append(int(drafter.draft_to_target(torch.tensor(draft_id, device=self.device))))
            parents.append(-1)
            scores.append(score)
        frontier_hidden = sequence.draft_hidden[None].expand(topk, -1)  # hidden each frontier node is fed
        expanded: list[int] = []  # candidate ids whose keys are in tree_keys, in order
        tree_keys = tree_values = None
        cache = sequence.draft_cache
        for step in range(1, self.spec.num_steps):
            embeds = self._embed([tokens[c] for c in frontier])
            positions = torch.full((1, topk), root_position + step, device=self.device)
            q, k, v = layer.project_qkv(embeds, frontier_hidden[None], positions)
            expanded.extend(frontier)
            tree_keys = k if tree_keys is None else torch.cat([tree_keys, k], dim=2)
            tree_values = v if tree_values is None else torch.cat([tree_values, v], dim=2)
            allowed = torch.ones(topk, cache.length + len(expanded), dtype=torch.bool, device=self.device)
            for row, node in enumerate(frontier):
                path = _ancestors_and_self(node, parents)
                allowed[row, cache.length :] = torch.tensor([c in path for c in expanded], device=self.device)
            attn = attend(q, torch.cat([cache.keys, tree_keys], 2), torch.cat([cache.values, tree_values], 2), allowed)
            hidden_out = layer.finish(attn, residual=frontier_hidden[None])[0]
            step_log_probs = torch.log_softmax(drafter.logits(hidden_out).float(), dim=-1)  # [topk, Vd]
            child_scores, child_ids = step_log_probs.topk(topk, dim=-1)
            child_scores = child_scores + torch.tensor([scores[c] for c in frontier], device=child_scores.device)[:, None]
            first_child = len(tokens)
            for row, node in enumerate(frontier):
                for col in range(topk):
                    tokens.append(int(drafter.draft_to_target(child_ids[row, col])))
                    parents.append(node)
                    scores.append(float(child_scores[row, col]))
            best = child_scores.flatten().topk(topk).indices.tolist()
            frontier = [first_child + i for i in best]
            frontier_hidden = hidden_out[[i // topk for i in best]]
        return _select_tree(sequence.tokens[-1], tokens, parents, scores, self.spec.num_draft_tokens - 1)


# --------------------------------------------------------------------------------------------- tree helpers


def _ancestors_and_self(node: int, parents: list[int]) -> set[int]:
    path = set()
    while node != -1:
        path.add(node)
        node = parents[node]
    return path


def _select_tree(root_token: int, tokens: list[int], parents: list[int], scores: list[float], budget: int) -> DraftTree:
    """The `budget` best candidates (a node only with its parent), in candidate order so parents come first;
    siblings are ordered best first, which is the order rejection sampling tries them in."""
    by_score = sorted(range(len(tokens)), key=lambda c: (-scores[c], c))
    chosen: set[int] = set()
    for candidate in by_score:
        if len(chosen) == budget:
            break
        if parents[candidate] == -1 or parents[candidate] in chosen:
            chosen.add(candidate)
    order = sorted(chosen, key=lambda c: (len(_ancestors_and_self(c, parents)), -scores[c], c))
    node_of = {candidate: i + 1 for i, candidate in enumerate(order)}
    return DraftTree(
        tokens=[root_token] + [tokens[c] for c in order],
        parents=[-1] + [0 if parents[c] == -1 else node_of[parents[c]] for c in order],
        draft_probs=[None] * (len(order) + 1),
    )


def _accept(tree: DraftTree, logits: torch.Tensor, params: SamplingParams, generator) -> tuple[list[int], int]:
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


# ------------------------------------------------------------------------------------------------ checks etc.


def _check_speculative(spec: SpeculativeConfig) -> None:
    if spec.algorithm.upper() != "EAGLE3":
        raise ValueError(
            f"engine.speculative.algorithm {spec.algorithm!r}: the reference engine implements EAGLE3 only "
            "(EAGLE-1/2 drafters read one hidden state, not three); set engine.speculative.algorithm=EAGLE3"
        )
    if spec.eagle_topk > 1 and spec.num_draft_tokens < 2:
        raise ValueError(
            f"engine.speculative.num_draft_tokens {spec.num_draft_tokens}: a tree (eagle_topk > 1) verifies the root "
            "plus at least one draft; set num_draft_tokens >= 2"
        )


def _check_drafter_fits_target(drafter, model, drafter_dir: Path) -> None:
    config = drafter.config
    problems = []
    if config.target_hidden_size != model.config.hidden_size:
        problems.append(f"target_hidden_size {config.target_hidden_size} != target hidden_size {model.config.hidden_size}")
    if config.target_vocab_size != model.config.vocab_size:
        problems.append(f"vocab_size {config.target_vocab_size} != target vocab_size {model.config.vocab_size}")
    problems += capture_id_problems(config.aux_layer_ids, model.config.num_hidden_layers)
    if problems:
        raise ValueError(f"drafter {drafter_dir} was not trained for this target: " + "; ".join(problems))


def _check_request(prompt_ids: list[int], params: SamplingParams, max_positions: int, vocab_size: int) -> None:
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: give at least one token")
    if len(prompt_ids) >= max_positions:
        raise ValueError(f"prompt has {len(prompt_ids)} tokens; the target handles at most {max_positions - 1}")
    if any(not 0 <= t < vocab_size for t in prompt_ids):
        raise ValueError(f"prompt_ids hold ids outside the target vocabulary [0, {vocab_size})")
    if params.temperature < 0 or not 0 < params.top_p <= 1 or params.max_new_tokens < 1:
        raise ValueError(
            f"sampling params temperature={params.temperature} (>= 0), top_p={params.top_p} (in (0, 1]), "
            f"max_new_tokens={params.max_new_tokens} (>= 1)"
        )


def _truncate(
    pending: list[int], sequence: Sequence, max_new_tokens: int, stop_ids: set[int], max_positions: int, lookahead: int
) -> tuple[list[int], Optional[str]]:
    """Cut newly committed tokens at a stop token or the token budget -> (tokens to emit, finish reason or None).
    Tokens past the cut are dropped from the sequence too, so stats count only emitted tokens."""
    generated = len(sequence.tokens) - sequence.prompt_length
    already = generated - len(pending)
    emitted: list[int] = []
    reason = None
    for token in pending:
        emitted.append(token)
        if token in stop_ids:
            reason = "stop"
            break
        if already + len(emitted) >= max_new_tokens:
            reason = "length"
            break
    if reason is None and len(sequence.tokens) + lookahead > max_positions:
        reason = "length"  # the next verify would run past the target's positions
    del sequence.tokens[sequence.prompt_length + already + len(emitted) :]
    # accepted drafts come first in a step's tokens, the bonus last: a cut drops the bonus, then drafts
    sequence.stats.accepted_draft_tokens -= sequence.pending_drafts - min(sequence.pending_drafts, len(emitted))
    sequence.pending_drafts = 0
    return emitted, reason


class _IncrementalText:
    """Streams text for token chunks; holds back a trailing partial UTF-8 character until it completes."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = ""

    def push(self, token_ids: list[int], final: bool) -> str:
        self.ids.extend(token_ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not final and text.endswith("\ufffd"):
            return ""
        new, self.sent = text[len(self.sent) :], text
        return new

