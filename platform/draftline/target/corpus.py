"""Text every machine has: (signature, docstring) pairs from Python's standard library.

The embedded target learns to answer "what does `def f(x)` do?" with the docstring, so its greedy replies are real,
structured, model-generated text: the distribution a drafter has to learn.
"""

from __future__ import annotations

import ast
import functools
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from draftline.utils import atomic_write_json, read_json, stable_hash


@dataclass(frozen=True)
class DocPair:
    key: str  # module.qualname: a stable id
    prompt: str
    answer: str


def _signature(node: ast.AST) -> str:
    if isinstance(node, ast.ClassDef):
        return f"class {node.name}"
    args = ast.unparse(node.args) if hasattr(ast, "unparse") else ""
    return f"def {node.name}({args})"


def _first_paragraph(doc: str, max_chars: int = 400) -> str:
    paragraph = doc.strip().split("\n\n", 1)[0]
    return " ".join(paragraph.split())[:max_chars]


_SKIPPED_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo"}


def _stdlib_sources() -> tuple[Path, list[Path]]:
    """(the standard library's directory, its .py files outside _SKIPPED_DIRS in sorted order): what
    stdlib_doc_pairs reads. Walked without entering the skipped directories (site-packages can be large)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources: list[Path] = []
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = [d for d in dirs if d not in _SKIPPED_DIRS]
        sources += [Path(root, f) for f in files if f.endswith(".py")]
    return stdlib, sorted(sources)


@functools.lru_cache(maxsize=4)  # parsing the standard library takes seconds; callers only read the list
def stdlib_doc_pairs(max_bytes: int) -> list[DocPair]:
    """Deterministic list of pairs, read in sorted file order until `max_bytes` of answer text."""
    stdlib, sources = _stdlib_sources()
    pairs: list[DocPair] = []
    total_bytes = 0
    for path in sources:
        rel = path.relative_to(stdlib)
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = ".".join(rel.with_suffix("").parts)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 20 or not doc.isascii():
                continue
            answer = _first_paragraph(doc)
            prompt = f"What does `{_signature(node)}` in {module} do?"
            if len(prompt) > 300:
                continue
            pairs.append(DocPair(key=f"{module}.{node.name}.{node.lineno}", prompt=prompt, answer=answer))
            total_bytes += len(answer) + len(prompt)
            if total_bytes >= max_bytes:
                return pairs
    return pairs


def corpus_hash(pairs: list[DocPair]) -> str:
    return stable_hash([(p.key, p.prompt, p.answer) for p in pairs])[:16]


def stdlib_corpus_hash(max_bytes: int, cache_dir: Path) -> str:
    """corpus_hash(stdlib_doc_pairs(max_bytes)), kept in `cache_dir` under a fingerprint of what the pairs are made
    from: this module's code and the name, size and mtime of every file they are read from. Finding the embedded
    target needs this hash, and every process that looks it up (a Serve replica, a Ray worker, each command) spent
    2-5 CPU s parsing the standard library for it; a lookup of the fingerprint takes milliseconds."""
    _, sources = _stdlib_sources()
    stats = []
    for source in sources:
        stat = source.stat()
        stats.append((str(source), stat.st_size, stat.st_mtime_ns))
    fingerprint = stable_hash(max_bytes, Path(__file__).read_text(), stats)[:16]
    path = cache_dir / f"stdlib-{fingerprint}.json"
    try:
        return str(read_json(path)["corpus_hash"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not cached yet (or a damaged file, rewritten below)
    value = corpus_hash(stdlib_doc_pairs(max_bytes))
    atomic_write_json(path, {"corpus_hash": value, "max_bytes": max_bytes, "files": len(stats)})
    return value
