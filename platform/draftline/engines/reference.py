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

Continuous batching: one scheduler loop (`_schedule`) owns the model. Between steps, new requests join and
finished or cancelled ones leave. Joining requests are prefilled together (one target forward over their prompts,
right-padded, each row causal over its own tokens, then one drafter extend) and become rows of the running
`Caches`: the target's `TargetBatch` and the drafter's `DraftBatch`, row b of each the same request. A step
drafts for every row at once (a chain: one drafter forward per depth over all rows; a tree: one per step over
the [rows, topk] frontier), then verifies all rows in one target forward: each row holds its tree (root first)
padded to the widest, with its own positions and a mask that lets it see only its valid cache slots plus its
ancestors. Rejected drafts' target slots stay masked instead of being cropped; the batch compacts when a column
is unused by every row. The drafter's cache is preallocated with slot = position, so a rejected draft costs
nothing: the row's length simply stops before it. Each request keeps its own sampling generator, so a seeded
request draws the same tokens at any concurrency. Targets whose HF cache is not plain full attention step one
request at a time.
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
from draftline.drafter.model import attend
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

    def add(self, cache, valid: torch.Tensor) -> None:
        """Append the rows of a prefilled cache (its slot validity `valid` [n, S]) after the existing rows."""
        if self.cache is None:
            self.cache, self.valid = cache, valid
            return
        width = max(self.valid.shape[1], valid.shape[1])
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


class DraftBatch:
    """The drafter's KV cache of running sequences, preallocated: keys/values [B, kv_heads, capacity, D].

    Slot s of a row holds the drafter's entry at position s, so a row's committed entries are its slots
    0..lengths[b]-1 and dropping rejected drafts is just a shorter length (no cropping, no copy). A forward writes
    its tokens' keys at their positions and a query at position p reads slots 0..p: committed entries, and the
    entries this round wrote before it (chain drafts, or the earlier tokens of an extend). Slots past a row's
    length are stale until the next forward overwrites them before anything reads them. `logits`/`hidden` [B, ...]
    are each row's drafter output at its last committed position, which drafts the next round's first token.
    Capacity doubles when a forward would run past it."""

    def __init__(self) -> None:
        self.keys: Optional[torch.Tensor] = None  # [B, kv_heads, capacity, D]
        self.values: Optional[torch.Tensor] = None
        self.lengths: list[int] = []
        self.logits: Optional[torch.Tensor] = None  # [B, Vd]
        self.hidden: Optional[torch.Tensor] = None  # [B, H]

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def add(self, other: "DraftBatch") -> None:
        """Append other's rows after the existing ones."""
        if self.keys is None:
            vars(self).update(vars(other))
            return
        width = max(self.keys.shape[2], other.keys.shape[2])
        self.keys = torch.cat([_pad_slots(self.keys, width), _pad_slots(other.keys, width)])
        self.values = torch.cat([_pad_slots(self.values, width), _pad_slots(other.values, width)])
        self.lengths = self.lengths + other.lengths
        self.logits, self.hidden = torch.cat([self.logits, other.logits]), torch.cat([self.hidden, other.hidden])

    def keep_rows(self, rows: list[int]) -> None:
        if self.keys is None:
            return
        if not rows:
            vars(self).update(vars(DraftBatch()))
            return
        index = torch.tensor(rows, device=self.keys.device)
        self.keys, self.values = self.keys.index_select(0, index), self.values.index_select(0, index)
        self.logits, self.hidden = self.logits.index_select(0, index), self.hidden.index_select(0, index)
        self.lengths = [self.lengths[row] for row in rows]

    def forward(self, drafter, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """Drafter over new tokens of every row: embeds, hidden [B, T, H], positions [B, T] ->
        (logits [B, T, Vd], hidden_out [B, T, H]). Keys land in slot = position; query at p sees slots <= p."""
        layer = drafter.midlayer
        q, k, v = layer.project_qkv(embeds, hidden, positions)
        end = int(positions.max()) + 1
        self._reserve(end, like=k)
        index = positions[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        self.keys.scatter_(2, index, k)
        self.values.scatter_(2, index, v)
        allowed = torch.arange(end, device=positions.device)[None, None] <= positions[:, :, None]  # [B, T, end]
        attn = attend(q, self.keys[:, :, :end], self.values[:, :, :end], allowed[:, None])
        hidden_out = layer.finish(attn, residual=hidden)
        return drafter.logits(hidden_out), hidden_out

    def _reserve(self, slots: int, like: torch.Tensor) -> None:
        if self.keys is None:
            shape = (like.shape[0], like.shape[1], max(slots, 64), like.shape[3])
            self.keys, self.values = like.new_zeros(shape), like.new_zeros(shape)
        elif slots > self.keys.shape[2]:
            self.keys = _pad_slots(self.keys, max(slots, 2 * self.keys.shape[2]))
            self.values = _pad_slots(self.values, self.keys.shape[2])


@dataclass
class Caches:
    """Both KV caches of a set of sequences; row b of each is the same sequence."""

    target: TargetBatch = field(default_factory=TargetBatch)
    draft: DraftBatch = field(default_factory=DraftBatch)

    def add(self, other: "Caches") -> None:
        if other.target.rows == 0:
            return
        self.target.add(other.target.cache, other.target.valid)
        self.draft.add(other.draft)

    def keep_rows(self, rows: list[int]) -> None:
        self.target.keep_rows(rows)
        self.draft.keep_rows(rows)


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
    """One request's decoding state; its target and drafter KV live in a row of the running `Caches`."""

    tokens: list[int]  # prompt + emitted
    prompt_length: int
    params: SamplingParams
    stop_ids: set[int]
    generator: torch.Generator
    pending_drafts: int = 0  # how many of the newest committed tokens are accepted drafts (the rest: bonus/prefill)
    stats: SpecStats = field(default_factory=SpecStats)


@dataclass
class _Request:
    """A request inside the scheduler: its sequence and the queue its chunks stream through."""

    sequence: Sequence
    chunks: asyncio.Queue
    text: "_IncrementalText"
    cancelled: bool = False
    caches: Caches = field(default_factory=Caches)  # own row, only for an unbatchable target


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
        self._caches = Caches()  # the running requests' target and drafter KV, one row each
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
        self._caches = Caches()

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
            self._running, self._caches = [], Caches()
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
                    self._caches.keep_rows(live)
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
                self._running, self._caches = [], Caches()
                continue
            for request, chunk in events:
                request.chunks.put_nowait(chunk)
            finished = {id(request) for request, chunk in events if chunk.finished}
            self._running = [r for r in self._running + joining if id(r) not in finished]

    def _advance(self, running: list["_Request"], joining: list["_Request"]) -> list[tuple["_Request", GenerationChunk]]:
        """One scheduler step: a decode step for `running` (rows 0.. of the caches), then one batched prefill for
        `joining` (their first token streams now; their rows join after the running ones and decode from the next
        step). Finished rows leave. A target whose cache cannot be batched steps each request alone, in its own
        one-row caches."""
        events = []
        if self.batchable:
            decoding = [(running, self._caches)] if running else []
            prefilling = [(joining, self._caches)] if joining else []
        else:
            decoding = [([request], request.caches) for request in running]
            prefilling = [([request], request.caches) for request in joining]
        with torch.no_grad():
            for requests, caches in decoding:
                committed = self._step_batch([r.sequence for r in requests], caches)
                chunks = [self._chunk(r, pending) for r, pending in zip(requests, committed)]
                caches.keep_rows([row for row, chunk in enumerate(chunks) if not chunk.finished])
                events += zip(requests, chunks)
            for requests, caches in prefilling:
                joined = self._prefill([r.sequence for r in requests])
                chunks = [self._chunk(r, r.sequence.tokens[r.sequence.prompt_length :]) for r in requests]
                joined.keep_rows([row for row, chunk in enumerate(chunks) if not chunk.finished])
                caches.add(joined)
                events += zip(requests, chunks)
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
        with torch.no_grad():
            caches = self._prefill([sequence])
            pending = sequence.tokens[sequence.prompt_length :]
            while self._cut(pending, sequence)[1] is None:
                pending = self._step_batch([sequence], caches)[0]
        sequence.stats.output_tokens = len(sequence.tokens) - sequence.prompt_length
        return sequence.tokens[sequence.prompt_length :], sequence.stats

    def _new_sequence(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        generator = torch.Generator(device=self.device)
        generator.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, ())))
        stop_ids = self.stop_token_ids | set(params.stop_token_ids)
        return Sequence(list(prompt_ids), len(prompt_ids), params, stop_ids, generator)

    def _prefill(self, sequences: list[Sequence]) -> Caches:
        """One target forward over every prompt, right-padded to the longest (row b: causal over its own tokens);
        picks each first token; primes the drafter on each prompt. -> the new rows' caches."""
        from transformers import DynamicCache

        started = time.perf_counter()
        lengths = [len(sequence.tokens) for sequence in sequences]
        width = max(lengths)
        ids = torch.zeros(len(sequences), width, dtype=torch.long)
        for row, sequence in enumerate(sequences):
            ids[row, : lengths[row]] = torch.tensor(sequence.tokens)
        in_prompt = torch.arange(width)[None] < torch.tensor(lengths)[:, None]  # [n, width]
        allowed = torch.ones(width, width, dtype=torch.bool).tril()[None] & in_prompt[:, None, :]  # key <= query, real
        positions = torch.arange(width)[None].expand(len(sequences), -1)
        caches = Caches()
        no_slots = torch.zeros(len(sequences), 0, dtype=torch.bool, device=self.device)
        caches.target.add(DynamicCache(config=self.model.config), no_slots)
        logits, aux = caches.target.forward(
            self.model, ids.to(self.device), positions.to(self.device), allowed.to(self.device), self._aux_layer_ids()
        )
        for row, sequence in enumerate(sequences):
            caches.target.commit(row, list(range(lengths[row])), width)
            sequence.tokens.append(self._pick(logits[row, lengths[row] - 1], sequence.params, sequence.generator))
        if self.drafter is not None:
            self._draft_extend(sequences, caches.draft, aux, starts=[0] * len(sequences), counts=lengths)
        self.phase_seconds["prefill"] += time.perf_counter() - started
        return caches

    def _step_batch(self, sequences: list[Sequence], caches: Caches) -> list[list[int]]:
        """One decode step for every sequence (row i of `caches`) -> the tokens each committed (1 for target-only;
        accepted drafts + bonus otherwise). Drafting runs every row in each drafter forward; the verify of all rows
        is one target forward: row b holds its tree (root first), padded to the widest tree."""
        started = time.perf_counter()
        if self.drafter is None:
            trees = [DraftTree([s.tokens[-1]], [-1], [None]) for s in sequences]
        elif self.spec.eagle_topk == 1:
            trees = self._draft_chains(sequences, caches.draft)
        else:
            trees = self._draft_trees(sequences, caches.draft)
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
        logits, aux = caches.target.forward(
            self.model, ids.to(self.device), positions.to(self.device), allowed.to(self.device), self._aux_layer_ids()
        )
        verified = time.perf_counter()
        committed, kept_nodes, starts = [], [], []
        for row, (sequence, tree) in enumerate(zip(sequences, trees)):
            path, bonus = _accept(tree, logits[row, : len(tree.tokens)], sequence.params, sequence.generator)
            kept = [0] + path  # the root and the accepted nodes become committed slots
            caches.target.commit(row, kept, width)
            accepted = [tree.tokens[node] for node in path]
            kept_nodes.append(kept)
            starts.append(len(sequence.tokens) - 1)  # the root's position
            sequence.tokens.extend(accepted + [bonus])
            if self.drafter is not None:
                sequence.stats.verify_steps += 1
                sequence.stats.accepted_draft_tokens += len(accepted)
                sequence.pending_drafts = len(accepted)
            committed.append(accepted + [bonus])
        caches.target.compact()
        accepted_at = time.perf_counter()
        if self.drafter is not None:
            # the drafter reads the target's aux states at the root and the accepted nodes (padded with the root)
            longest = max(len(kept) for kept in kept_nodes)
            nodes = torch.tensor([kept + [0] * (longest - len(kept)) for kept in kept_nodes], device=self.device)
            kept_aux = aux[torch.arange(len(sequences), device=self.device)[:, None], nodes]
            self._draft_extend(sequences, caches.draft, kept_aux, starts, counts=[len(kept) for kept in kept_nodes])
        phases = self.phase_seconds
        phases["draft"] += drafted - started + time.perf_counter() - accepted_at
        phases["verify"] += verified - drafted
        phases["accept"] += accepted_at - verified
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

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Target embeddings of token ids [B, T] -> [B, T, H] in the drafter's dtype."""
        return self.model.get_input_embeddings()(token_ids.to(self.device)).to(self.drafter.fc.weight.dtype)

    def _draft_extend(
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
        logits, hidden_out = drafts.forward(drafter, self._embed(next_tokens), hidden, positions)
        rows, last = torch.arange(len(sequences), device=self.device), torch.tensor(counts, device=self.device) - 1
        drafts.logits, drafts.hidden = logits[rows, last], hidden_out[rows, last]
        drafts.lengths = [start + count for start, count in zip(starts, counts)]

    def _draft_chains(self, sequences: list[Sequence], drafts: DraftBatch) -> list[DraftTree]:
        """num_steps tokens per row, each fed back into the drafter: one drafter forward over every row per step.
        Depth d's entry lands at position (= slot) L-2+d, after the row's committed entries 0..L-2."""
        drafter = self.drafter
        trees = [DraftTree([sequence.tokens[-1]], [-1], [None]) for sequence in sequences]
        logits, hidden = drafts.logits, drafts.hidden  # [B, Vd], [B, H]: the drafter at position L-2 predicts x_L
        first_position = torch.tensor([len(sequence.tokens) - 1 for sequence in sequences], device=self.device)
        for depth in range(1, self.spec.num_steps + 1):
            greedy_tokens = drafter.draft_to_target(logits.argmax(dim=-1)).tolist()
            for row, (sequence, tree) in enumerate(zip(sequences, trees)):
                if sequence.params.temperature == 0:
                    token, probs = greedy_tokens[row], None
                else:
                    probs = draft_probs_in_target_vocab(
                        drafter, logits[row], sequence.params.temperature, self.model.config.vocab_size
                    )
                    token = sample(probs, sequence.generator)
                tree.tokens.append(token)
                tree.parents.append(depth - 1)
                tree.draft_probs.append(probs)
            if depth == self.spec.num_steps:
                break
            step_ids = torch.tensor([[tree.tokens[-1]] for tree in trees])
            positions = (first_position + depth - 1)[:, None]
            step_logits, step_hidden = drafts.forward(drafter, self._embed(step_ids), hidden[:, None], positions)
            logits, hidden = step_logits[:, 0], step_hidden[:, 0]
        return trees

    def _draft_trees(self, sequences: list[Sequence], drafts: DraftBatch) -> list[DraftTree]:
        """SGLang's EAGLE tree for every row at once: each step expands the topk best paths (by summed draft
        log-prob) by their topk next tokens, one drafter forward over the [B, topk] frontier; the
        num_draft_tokens-1 best nodes over all steps form the tree the target verifies. Tree nodes' keys stay
        out of the drafter cache: several nodes share a position."""
        drafter, topk, layer, batch = self.drafter, self.spec.eagle_topk, self.drafter.midlayer, len(sequences)
        lengths = torch.tensor(drafts.lengths, device=self.device)
        cached = max(drafts.lengths)
        sees_cache = (torch.arange(cached, device=self.device)[None] < lengths[:, None])[:, None].expand(-1, topk, -1)
        root_positions = lengths - 1  # the drafter position of each root's last extend entry
        # candidate nodes per row: target token, parent candidate (-1 = root), cumulative log-prob
        top_scores, top_ids = torch.log_softmax(drafts.logits.float(), dim=-1).topk(topk, dim=-1)
        tokens = drafter.draft_to_target(top_ids).tolist()
        scores = top_scores.tolist()
        parents = [[-1] * topk for _ in range(batch)]
        frontier = [list(range(topk)) for _ in range(batch)]
        frontier_hidden = drafts.hidden[:, None].expand(-1, topk, -1)  # [B, topk, H]: what each frontier node is fed
        expanded: list[list[int]] = [[] for _ in range(batch)]  # candidates whose keys are in tree_keys, in order
        tree_keys = tree_values = None
        for step in range(1, self.spec.num_steps):
            embeds = self._embed(torch.tensor([[tokens[b][c] for c in frontier[b]] for b in range(batch)]))
            positions = (root_positions + step)[:, None].expand(-1, topk)
            q, k, v = layer.project_qkv(embeds, frontier_hidden, positions)
            tree_keys = k if tree_keys is None else torch.cat([tree_keys, k], dim=2)
            tree_values = v if tree_values is None else torch.cat([tree_values, v], dim=2)
            for b in range(batch):
                expanded[b].extend(frontier[b])
            # frontier node i of row b sees its row's committed entries and its own ancestors among the expanded
            paths = [[_ancestors_and_self(node, parents[b]) for node in frontier[b]] for b in range(batch)]
            sees_tree = torch.tensor([[[c in path for c in expanded[b]] for path in paths[b]] for b in range(batch)])
            allowed = torch.cat([sees_cache, sees_tree.to(self.device)], dim=-1)
            keys = torch.cat([drafts.keys[:, :, :cached], tree_keys], dim=2)
            values = torch.cat([drafts.values[:, :, :cached], tree_values], dim=2)
            hidden_out = layer.finish(attend(q, keys, values, allowed[:, None]), residual=frontier_hidden)
            step_log_probs = torch.log_softmax(drafter.logits(hidden_out).float(), dim=-1)  # [B, topk, Vd]
            child_scores, child_ids = step_log_probs.topk(topk, dim=-1)  # [B, topk parents, topk children]
            parent_scores = torch.tensor([[scores[b][c] for c in frontier[b]] for b in range(batch)])
            child_scores = child_scores + parent_scores.to(child_scores.device)[..., None]  # path log-prob
            best = child_scores.flatten(1).topk(topk, dim=-1).indices  # [B, topk] over parent*topk + child
            child_tokens, child_score_list = drafter.draft_to_target(child_ids).tolist(), child_scores.tolist()
            for b in range(batch):
                first_child = len(tokens[b])
                for row, node in enumerate(frontier[b]):
                    tokens[b].extend(child_tokens[b][row])
                    parents[b].extend([node] * topk)
                    scores[b].extend(child_score_list[b][row])
                frontier[b] = [first_child + i for i in best[b].tolist()]
            frontier_hidden = hidden_out[torch.arange(batch, device=self.device)[:, None], best // topk]
        budget = self.spec.num_draft_tokens - 1
        return [_select_tree(s.tokens[-1], tokens[b], parents[b], scores[b], budget) for b, s in enumerate(sequences)]


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

