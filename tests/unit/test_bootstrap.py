"""The embedded tiny target is a real language model, loads like any HF model, and is cached by content hash."""

from __future__ import annotations

import json

import pytest

from draftline.target.bootstrap import bootstrap_summary, bootstrap_target
from draftline.target.load import default_aux_layer_ids, load_target, target_fingerprint


def test_tiny_target_is_a_real_language_model(tiny_target_dir):
    summary = bootstrap_summary(tiny_target_dir)
    # Far below a uniform guess over the vocabulary, and below a unigram model of the same text.
    assert summary["heldout_perplexity"] < summary["uniform_perplexity"] / 20
    assert summary["heldout_perplexity"] < summary["unigram_perplexity"] / 2


def test_loads_with_transformers_and_has_chat_template(tiny_cfg, tiny_target_dir):
    target = load_target(tiny_cfg, target_dir=tiny_target_dir)
    assert target.num_layers == 8 and target.hidden_size == 96
    text = target.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|bos|><|user|>hi<|end|><|assistant|>"
    assert target.fingerprint == target_fingerprint(tiny_target_dir)
    conversations = [json.loads(l) for l in open(tiny_target_dir / "conversations.jsonl")]
    assert len(conversations) == tiny_cfg.target.embedded.num_conversations
    assert all(c["messages"][-1]["role"] == "assistant" for c in conversations)


def test_second_bootstrap_is_cached(tiny_cfg, tiny_target_dir, monkeypatch):
    """The cache is hit: nothing is built again and no file of the target is rewritten."""
    import draftline.target.bootstrap as bootstrap

    before = {p: p.stat().st_mtime_ns for p in tiny_target_dir.rglob("*") if p.is_file()}
    monkeypatch.setattr(bootstrap, "_build_target", lambda *a: pytest.fail("the cached target was built again"))
    assert bootstrap_target(tiny_cfg) == tiny_target_dir
    assert {p: p.stat().st_mtime_ns for p in tiny_target_dir.rglob("*") if p.is_file()} == before


def test_default_aux_layers_match_sglang():
    # SGLang captures the inputs of layers [2, n//2, n-3] = outputs of [1, n//2-1, n-4].
    assert default_aux_layer_ids(32) == [1, 15, 28]
    assert default_aux_layer_ids(8) == [1, 3, 4]


def test_the_corpus_hash_is_parsed_once_then_read_until_its_sources_change(tmp_path, monkeypatch):
    """Finding the embedded target needs the hash of its corpus. Each process that looked it up (every Serve replica,
    Ray worker and command) parsed the standard library for it, 2-5 CPU s; it is now kept on disk under a
    fingerprint of the sources, and parsed again only when that fingerprint changes or the kept file is damaged."""
    import draftline.target.corpus as corpus

    max_bytes = 20_000  # a few files of the standard library
    expected = corpus.corpus_hash(corpus.stdlib_doc_pairs(max_bytes))
    parsed: list[int] = []
    real_pairs = corpus.stdlib_doc_pairs.__wrapped__

    def counting_pairs(n: int):
        parsed.append(n)
        return real_pairs(n)

    monkeypatch.setattr(corpus, "stdlib_doc_pairs", counting_pairs)
    assert corpus.stdlib_corpus_hash(max_bytes, tmp_path) == expected and parsed == [max_bytes]
    assert corpus.stdlib_corpus_hash(max_bytes, tmp_path) == expected and parsed == [max_bytes]  # read, not parsed

    (kept,) = tmp_path.glob("stdlib-*.json")
    kept.write_text("{not json")
    assert corpus.stdlib_corpus_hash(max_bytes, tmp_path) == expected and len(parsed) == 2

    stdlib, sources = corpus._stdlib_sources()
    monkeypatch.setattr(corpus, "_stdlib_sources", lambda: (stdlib, sources[1:]))  # a file less: a new fingerprint
    corpus.stdlib_corpus_hash(max_bytes, tmp_path)
    assert len(parsed) == 3 and len(list(tmp_path.glob("stdlib-*.json"))) == 2
