"""Reference engine: aux capture, losslessness (greedy token-identical, sampling distribution-identical), streaming.

The drafter is either randomly initialised (almost every draft rejected: exercises rejection/residual paths) or
fitted in-process for a few hundred steps (`quick_drafter`, cached on disk: most drafts accepted).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from draftline.engines.reference import acceptance
from draftline.engines.reference.kv_cache import DraftBatch, target_forward
from draftline.data.prepare import load_split
from draftline.engines import make_engine
from draftline.engines.base import SamplingParams
from draftline.target.capture import capture_aux_hidden
from conftest import make_test_config

CHAIN_AND_TREE = [(3, 1, 4), (5, 1, 6), (3, 2, 6), (4, 4, 8)]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def spec_overrides(num_steps: int, topk: int, draft_tokens: int) -> list[str]:
    return [
        f"engine.speculative.num_steps={num_steps}",
        f"engine.speculative.eagle_topk={topk}",
        f"engine.speculative.num_draft_tokens={draft_tokens}",
    ]


def prompt_ids(sample: dict) -> list[int]:
    """Conversation up to (and including) the assistant header: where the target starts replying."""
    return sample["input_ids"][: sample["loss_mask"].index(1)]


@pytest.fixture(scope="module")
def prompts(tiny_dataset_dir):
    samples = load_split(tiny_dataset_dir, "bench") + load_split(tiny_dataset_dir, "val")
    return [prompt_ids(s) for s in samples if 1 in s["loss_mask"]]


@pytest.fixture(scope="module")
def target_engine(tiny_cfg, tiny_target_dir):
    engine = make_engine(tiny_cfg, tiny_target_dir)
    engine.load()
    return engine


def loaded_engine(target_dir, drafter_dir, spec=(3, 1, 4)):
    engine = make_engine(make_test_config(extra=spec_overrides(*spec)), target_dir, drafter_dir, model_version="test")
    engine.load()
    return engine


def test_engine_aux_states_are_capture_aux_hidden(target_engine, prompts):
    """The engine's cached, chunked target passes feed the drafter exactly what extraction trains on."""
    from transformers import DynamicCache

    model, ids = target_engine.model, prompts[0]
    aux_layer_ids = [1, 3, 4]
    expected, _ = capture_aux_hidden(model, torch.tensor([ids]), None, aux_layer_ids)
    cache = DynamicCache(config=model.config)
    split = len(ids) // 2
    chunks = []
    for start, stop in ((0, split), (split, len(ids))):
        positions = torch.arange(start, stop)[None]
        _, aux = target_forward(model, torch.tensor([ids[start:stop]]), positions, cache, aux_layer_ids)
        chunks.append(aux[0])
    torch.testing.assert_close(torch.cat(chunks), expected[0], atol=1e-5, rtol=1e-5)


def test_target_only_greedy_equals_hf_generate(target_engine, prompts):
    model = target_engine.model
    for ids in prompts[:4]:
        ours, stats = target_engine.generate_ids(ids, SamplingParams(max_new_tokens=24))
        hf = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, attention_mask=torch.ones(1, len(ids)))
        theirs = hf[0, len(ids) :].tolist()
        assert ours and ours == theirs  # both stop at EOS or after 24 tokens
        assert stats.output_tokens == len(ours) and stats.verify_steps == 0


def assert_greedy_identical(target_engine, engine, prompts) -> None:
    params = SamplingParams(max_new_tokens=48)
    total_output = total_steps = 0
    for ids in prompts:
        expected, _ = target_engine.generate_ids(ids, params)
        got, stats = engine.generate_ids(ids, params)
        assert got == expected, f"prompt {ids}: speculative output differs from the target's"
        total_output += stats.output_tokens
        total_steps += stats.verify_steps
    assert total_output / total_steps > 1.5, "the fitted drafter should get drafts accepted (else this test is vacuous)"


@pytest.mark.parametrize("spec", [(3, 1, 4), (3, 2, 6)], ids=["chain", "tree"])
def test_greedy_speculative_is_token_identical_to_target(target_engine, tiny_target_dir, fitted_drafter_dir, prompts, spec):
    assert_greedy_identical(target_engine, loaded_engine(tiny_target_dir, fitted_drafter_dir, spec), prompts[:10])


@pytest.mark.parametrize("spec", CHAIN_AND_TREE, ids=lambda s: "steps%d-topk%d-draft%d" % s)
def test_greedy_speculative_is_token_identical_on_every_prompt(
    target_engine, tiny_target_dir, fitted_drafter_dir, prompts, spec
):
    assert_greedy_identical(target_engine, loaded_engine(tiny_target_dir, fitted_drafter_dir, spec), prompts)


def test_greedy_with_a_random_drafter_is_still_token_identical(target_engine, tiny_target_dir, random_drafter_dir, prompts):
    for spec in [(3, 1, 4), (3, 2, 6)]:
        engine = loaded_engine(tiny_target_dir, random_drafter_dir, spec)
        for ids in prompts[:8]:
            params = SamplingParams(max_new_tokens=24)
            assert engine.generate_ids(ids, params)[0] == target_engine.generate_ids(ids, params)[0]


def chi_square_p_value(observed: torch.Tensor, expected_probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Goodness of fit; categories with expected count < min_expected are pooled into one."""
    total = float(observed.sum())
    expected = expected_probs.double() * total
    big = expected >= min_expected
    obs = torch.cat([observed[big].double(), observed[~big].double().sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    statistic = float((((obs - exp) ** 2) / exp)[keep].sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(statistic / 2.0)))


def exact_two_token_distribution(model, ids: list[int], temperature: float) -> torch.Tensor:
    """P(t1, t2 | prompt) under the target, flattened over [V * V] (one batched forward over every t1)."""
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([ids])).logits[0, -1].float() / temperature, -1)
        vocab = first.shape[0]
        batch = torch.cat([torch.tensor([ids]).expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
        second = torch.cat(
            [torch.softmax(model(chunk).logits[:, -1].float() / temperature, -1) for chunk in batch.split(512)]
        )
    return (first[:, None] * second).flatten()


def accept_every_draft(monkeypatch) -> None:
    """A broken acceptance rule for chains and trees: every draft accepted, the bonus sampled from the target."""

    def every_chain_draft(drafts, logits, sequences):
        last = drafts.steps
        bonus = [
            torch.multinomial(acceptance.target_probs(logits[row, last], s.params.temperature, s.params.top_p), 1,
                              generator=s.generator)[0]
            for row, s in enumerate(sequences)
        ]  # fmt: skip
        return torch.full((len(sequences),), last), torch.stack(bonus)

    def every_tree_draft(tree, logits, params, generator):
        path, node = [], 0
        while tree.children(node):
            node = tree.children(node)[0]
            path.append(node)
        return path, acceptance.sample(acceptance.target_probs(logits[node], params.temperature, params.top_p), generator)

    monkeypatch.setattr(acceptance, "accept_chains", every_chain_draft)
    monkeypatch.setattr(acceptance, "accept_tree", every_tree_draft)


def sampled_pairs(engine, ids: list[int], temperature: float, num_samples: int) -> torch.Tensor:
    vocab = engine.model.config.vocab_size
    counts = torch.zeros(vocab * vocab)
    for seed in range(num_samples):
        out, _ = engine.generate_ids(ids, SamplingParams(max_new_tokens=2, temperature=temperature, seed=seed))
        counts[out[0] * vocab + out[1]] += 1
    return counts


@pytest.mark.parametrize("spec", [(2, 1, 3), (2, 2, 4)], ids=["chain", "tree"])
@pytest.mark.parametrize("drafter_kind", ["fitted", "random"])
def test_sampling_output_distribution_equals_the_targets(
    tiny_target_dir, fitted_drafter_dir, random_drafter_dir, prompts, spec, drafter_kind, monkeypatch
):
    """Chi-square of (token 1, token 2) samples against the target's exact joint distribution.

    Token 2 is the first drafted position, so it goes through drafting, rejection sampling and the residual.
    With the random drafter (drafts far from the target) the same statistic must reject a broken acceptance
    rule (accept every draft), so the test can fail.
    """
    drafter_dir = fitted_drafter_dir if drafter_kind == "fitted" else random_drafter_dir
    engine = loaded_engine(tiny_target_dir, drafter_dir, spec)
    engine.stop_token_ids = set()  # every sample has two tokens (the exact distribution has no stopping)
    ids, temperature = prompts[1], 1.0
    exact = exact_two_token_distribution(engine.model, ids, temperature)
    p_value = chi_square_p_value(sampled_pairs(engine, ids, temperature, 600), exact)
    assert p_value > 1e-3, f"speculative samples do not follow the target distribution (p={p_value:.2e})"
    if drafter_kind == "fitted":
        return

    accept_every_draft(monkeypatch)
    broken_p_value = chi_square_p_value(sampled_pairs(engine, ids, temperature, 600), exact)
    assert broken_p_value < 1e-3, "the statistic failed to detect a broken acceptance rule"


def later_token_pit(engine, ids: list[int], temperature: float, top_p: float, num_samples: int, positions=(2, 3)):
    """Randomised probability integral transform of output tokens at later positions: u ~ U(0, 1) exactly when
    each token follows the target's (temperature, top_p) distribution given the tokens before it.
    The CDF orders the vocabulary by target probability, so tokens the target finds unlikely land near u = 1."""
    generator = torch.Generator().manual_seed(123)
    values = []
    for seed in range(num_samples):
        out, _ = engine.generate_ids(ids, SamplingParams(max_new_tokens=max(positions) + 1, temperature=temperature,
                                                         top_p=top_p, seed=seed))  # fmt: skip
        with torch.no_grad():
            logits = engine.model(torch.tensor([ids + out])).logits[0]
        for k in positions:
            q = acceptance.target_probs(logits[len(ids) + k - 1], temperature, top_p)
            order = q.argsort(descending=True)
            cdf = q[order].cumsum(0)
            rank = int((order == out[k]).nonzero())
            below = float(cdf[rank - 1]) if rank else 0.0
            values.append(below + float(torch.rand((), generator=generator)) * (float(cdf[rank]) - below))
    return torch.tensor(values)


def uniformity_p_value(values: torch.Tensor, bins: int = 10) -> float:
    observed = torch.histc(values.clamp(0, 1 - 1e-9), bins=bins, min=0, max=1)
    return chi_square_p_value(observed, torch.full((bins,), 1 / bins))


@pytest.mark.parametrize("spec", [(3, 1, 4), (3, 2, 6)], ids=["chain", "tree"])
@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_sampling_later_tokens_follow_the_target(tiny_target_dir, random_drafter_dir, prompts, spec, top_p, monkeypatch):
    """Tokens 3 and 4 (second and third draft positions, and a later round) with and without nucleus sampling.
    The random drafter gets most drafts rejected, so the residual path is exercised; a broken acceptance rule
    (accept every draft) must be detected by the same statistic."""
    engine = loaded_engine(tiny_target_dir, random_drafter_dir, spec)
    engine.stop_token_ids = set()
    p_value = uniformity_p_value(later_token_pit(engine, prompts[1], 1.0, top_p, 300))
    assert p_value > 1e-3, f"later tokens do not follow the target distribution (top_p={top_p}, p={p_value:.2e})"

    accept_every_draft(monkeypatch)
    broken = uniformity_p_value(later_token_pit(engine, prompts[1], 1.0, top_p, 300))
    assert broken < 1e-3, "the statistic failed to detect a broken acceptance rule"


@pytest.mark.parametrize("spec", [None, (3, 1, 4), (3, 2, 6)], ids=["target-only", "chain", "tree"])
@pytest.mark.parametrize("concurrency", [2, 5])
def test_continuous_batching_is_token_identical_for_every_request(
    tiny_target_dir, fitted_drafter_dir, prompts, target_engine, spec, concurrency, monkeypatch
):
    """Requests with different budgets leave the batch at different steps and waiting ones join mid-flight;
    every output equals the target alone's, and the steps really were batched."""
    engine = target_engine if spec is None else loaded_engine(tiny_target_dir, fitted_drafter_dir, spec)
    jobs = [(ids, SamplingParams(max_new_tokens=8 + 5 * (i % 4))) for i, ids in enumerate(prompts[:10])]
    assert len({len(ids) for ids, _ in jobs}) > 1, "ragged prompts: the padded prefill and drafter rows are exercised"
    expected = [target_engine.generate_ids(ids, params)[0] for ids, params in jobs]
    batch_sizes, prefill_sizes, drafter_rows = [], [], []
    step_batch, prefill, draft_forward = engine._step_batch, engine._prefill, DraftBatch.forward

    def recording_step(sequences, caches):
        batch_sizes.append(len(sequences))
        return step_batch(sequences, caches)

    def recording_prefill(sequences):
        prefill_sizes.append(len(sequences))
        return prefill(sequences)

    def recording_draft_forward(drafts, drafter, embeds, hidden, positions):
        drafter_rows.append(embeds.shape[0])
        return draft_forward(drafts, drafter, embeds, hidden, positions)

    monkeypatch.setattr(engine, "_step_batch", recording_step)
    monkeypatch.setattr(engine, "_prefill", recording_prefill)
    monkeypatch.setattr(DraftBatch, "forward", recording_draft_forward)

    async def run_all():
        gate = asyncio.Semaphore(concurrency)

        async def one(ids, params):
            async with gate:
                return [t async for chunk in engine.generate(ids, params) for t in chunk.token_ids]

        return await asyncio.gather(*(one(ids, params) for ids, params in jobs))

    got = asyncio.run(run_all())
    for index, (ours, theirs) in enumerate(zip(got, expected)):
        assert ours == theirs, f"request {index} differs from the target alone at concurrency {concurrency}"
    assert max(batch_sizes) == concurrency
    assert max(prefill_sizes) == concurrency  # the first requests join together
    assert sum(prefill_sizes) == len(jobs)
    if spec is not None:
        assert max(drafter_rows) == concurrency  # drafter steps (chain) and extends (both) run every row at once


def test_seeded_sampling_is_the_same_alone_and_batched(tiny_target_dir, random_drafter_dir, prompts):
    """Each request keeps its own generator, so a seeded request draws the same tokens alone and in a batch
    whose drafter and verify forwards it shares with greedy and other sampled requests of other lengths."""
    for spec in [(3, 1, 4), (3, 2, 6)]:
        engine = loaded_engine(tiny_target_dir, random_drafter_dir, spec)
        jobs = [
            (ids, SamplingParams(max_new_tokens=6 + 3 * i, temperature=0.0 if i == 1 else 0.9, top_p=0.95, seed=i))
            for i, ids in enumerate(prompts[2:6])
        ]
        alone = [engine.generate_ids(ids, params)[0] for ids, params in jobs]

        async def run_all():
            async def one(ids, params):
                return [t async for chunk in engine.generate(ids, params) for t in chunk.token_ids]

            return await asyncio.gather(*(one(ids, params) for ids, params in jobs))

        assert asyncio.run(run_all()) == alone, f"spec {spec}"


def test_streaming_chunks_stop_and_concurrent_requests(tiny_target_dir, fitted_drafter_dir, prompts, target_engine):
    engine = loaded_engine(tiny_target_dir, fitted_drafter_dir)
    params = SamplingParams(max_new_tokens=20)

    async def collect(ids):
        chunks = [chunk async for chunk in engine.generate(ids, params)]
        return chunks

    async def run_all():
        return await asyncio.gather(*(collect(ids) for ids in prompts[:3]))

    for ids, chunks in zip(prompts[:3], asyncio.run(run_all())):
        tokens = [t for chunk in chunks for t in chunk.token_ids]
        assert tokens == target_engine.generate_ids(ids, params)[0]
        assert chunks[-1].finished and chunks[-1].finish_reason in ("stop", "length")
        assert all(not chunk.finished for chunk in chunks[:-1])
        assert chunks[-1].stats.output_tokens == len(tokens) <= 20
        assert "".join(chunk.text for chunk in chunks) == engine.tokenizer.decode(tokens, skip_special_tokens=True)


def test_max_new_tokens_and_stop_token_ids_cut_the_output(tiny_target_dir, fitted_drafter_dir, prompts, target_engine):
    engine = loaded_engine(tiny_target_dir, fitted_drafter_dir, (5, 1, 6))
    full, _ = target_engine.generate_ids(prompts[0], SamplingParams(max_new_tokens=30))
    short, stats = engine.generate_ids(prompts[0], SamplingParams(max_new_tokens=3))
    assert short == full[:3] and stats.output_tokens == 3
    # the cut drops drafts accepted past the budget: emitted = first token + emitted drafts + one bonus per full step
    bonus_tokens = stats.output_tokens - 1 - stats.accepted_draft_tokens
    assert bonus_tokens in (stats.verify_steps - 1, stats.verify_steps), stats
    stop_at = full[4]
    stopped, _ = engine.generate_ids(prompts[0], SamplingParams(max_new_tokens=30, stop_token_ids=[stop_at]))
    assert stopped == full[: full.index(stop_at) + 1]


def test_bad_requests_and_mismatched_drafter_are_refused(tiny_cfg, tiny_target_dir, target_engine, tmp_path):
    from draftline.drafter.export import export_drafter
    from draftline.drafter.model import DrafterConfig, Eagle3Drafter

    with pytest.raises(ValueError, match="prompt_ids is empty"):
        asyncio.run(anext(target_engine.generate([], SamplingParams())))
    with pytest.raises(ValueError, match="temperature"):
        asyncio.run(anext(target_engine.generate([5], SamplingParams(temperature=-1))))
    other = DrafterConfig(
        hidden_size=32, num_attention_heads=2, num_key_value_heads=2, head_dim=16, intermediate_size=64,
        draft_vocab_size=16, target_vocab_size=64, target_hidden_size=32, aux_layer_ids=(0, 1, 2),
    )
    export_drafter(Eagle3Drafter(other), tmp_path / "other")
    with pytest.raises(ValueError, match="not trained for this target"):
        make_engine(tiny_cfg, tiny_target_dir, tmp_path / "other").load()
    with pytest.raises(ValueError, match="implements EAGLE3 only"):
        make_engine(make_test_config(extra=["engine.speculative.algorithm=EAGLE"]), tiny_target_dir, tmp_path / "other")
