"""No benchmark prompt in training data: every user turn prepare reads is checked against the held-out benchmarks'
user turns (`data.held_out_benchmarks`), and a match is bad input of kind `benchmark` (dropped and counted, or an
error with data.on_bad_input=fail), in every split.

A turn matches a benchmark turn when, over lower-cased words and digits:
- it is the same text; or
- they share a run of NGRAM_WORDS words (the 13-gram test of the GPT-3 contamination study: long enough that two
  independent texts almost never share one); or
- at least JACCARD_MIN of their word 3-grams are shared (a short prompt copied with a word or two changed, which no
  13-word run can catch).
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Iterable, Optional

from draftline.data.benchmarks import Benchmark

NGRAM_WORDS = 13
SHORT_NGRAM_WORDS = 3
JACCARD_MIN = 0.5


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def ngrams(tokens: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)}


def user_turns(messages: list[dict]) -> Iterable[tuple[int, str]]:
    return ((i, m["content"]) for i, m in enumerate(messages) if m["role"] == "user")


class HeldOutIndex:
    """The user turns of the held-out benchmarks, indexed for the three tests."""

    def __init__(self, benchmarks: list[Benchmark]) -> None:
        self.labels: list[str] = []
        self.exact: dict[str, int] = {}
        self.long_runs: dict[tuple[str, ...], int] = {}
        self.short_grams: list[set[tuple[str, ...]]] = []
        self.by_short_gram: dict[tuple[str, ...], set[int]] = defaultdict(set)
        for benchmark in benchmarks:
            for conv in benchmark.conversations:
                for turn, text in user_turns(conv.messages):
                    self._add(f"{benchmark.name} {conv.id} turn {turn + 1}", words(text))

    def _add(self, label: str, tokens: list[str]) -> None:
        index = len(self.labels)
        self.labels.append(label)
        self.exact.setdefault(" ".join(tokens), index)
        for run in ngrams(tokens, NGRAM_WORDS):
            self.long_runs.setdefault(run, index)
        grams = ngrams(tokens, SHORT_NGRAM_WORDS)
        self.short_grams.append(grams)
        for gram in grams:
            self.by_short_gram[gram].add(index)

    def __len__(self) -> int:
        return len(self.labels)

    def match(self, text: str) -> Optional[str]:
        """Why `text` counts as a benchmark prompt, or None."""
        tokens = words(text)
        if not tokens:
            return None
        if (index := self.exact.get(" ".join(tokens))) is not None:
            return f"is {self.labels[index]}"
        for run in ngrams(tokens, NGRAM_WORDS):
            if (index := self.long_runs.get(run)) is not None:
                return f"shares the {NGRAM_WORDS}-word run {' '.join(run)!r} with {self.labels[index]}"
        grams = ngrams(tokens, SHORT_NGRAM_WORDS)
        candidates = set().union(*(self.by_short_gram.get(g, set()) for g in grams)) if grams else set()
        for index in sorted(candidates):
            theirs = self.short_grams[index]
            shared = len(grams & theirs) / len(grams | theirs)
            if shared >= JACCARD_MIN:
                return f"shares {shared:.0%} of its word {SHORT_NGRAM_WORDS}-grams with {self.labels[index]}"
        return None

    def conversation_match(self, messages: list[dict]) -> Optional[str]:
        for turn, text in user_turns(messages):
            if (why := self.match(text)) is not None:
                return f"user turn {turn + 1} {why}"
        return None
