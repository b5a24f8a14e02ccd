"""Text every machine has: (signature, docstring) pairs from Python's standard library.

The embedded target learns to answer "what does `def f(x)` do?" with the docstring, so its greedy replies are real,
structured, model-generated text: the distribution a drafter has to learn.
"""

from __future__ import annotations

import ast
import functools
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from draftline.utils import stable_hash


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


@functools.lru_cache(maxsize=4)  # parsing the standard library takes seconds; callers only read the list
def stdlib_doc_pairs(max_bytes: int) -> list[DocPair]:
    """Deterministic list of pairs, read in sorted file order until `max_bytes` of answer text."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    pairs: list[DocPair] = []
    total_bytes = 0
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if any(part in {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo"} for part in rel.parts):
            continue
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
