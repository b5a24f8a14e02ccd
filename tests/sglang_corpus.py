"""Launch commands for the differential test: the seed's incident, each rule, each miss of issue 17, valid commands.

`corpus(target, draft)` gives (case id, argv without the launcher) pairs; the same list runs for every release, so a
flag a release lacks is an unknown-flag case there. `write_models(dir)` writes the two model directories they name
(config.json only, Llama-3.1-8B shapes and an EAGLE-3 draft for it): what SGLang reads before loading weights.
"""

from __future__ import annotations

import json
from pathlib import Path

TARGET_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}  # fmt: skip
DRAFT_CONFIG = {
    **TARGET_CONFIG, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1, "draft_vocab_size": 32000,
    "target_hidden_size": 4096, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]},
}  # fmt: skip


def write_models(root: Path) -> tuple[Path, Path]:
    target, draft = root / "target", root / "draft"
    for path, config in ((target, TARGET_CONFIG), (draft, DRAFT_CONFIG)):
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(config))
    return target, draft


def chain(steps: int) -> list[str]:
    return ["--speculative-num-steps", str(steps), "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(steps + 1)]


def tree(steps: int, topk: int, draft_tokens: int) -> list[str]:
    return ["--speculative-num-steps", str(steps), "--speculative-eagle-topk", str(topk), "--speculative-num-draft-tokens", str(draft_tokens)]


def corpus(target: Path, draft: Path) -> list[tuple[str, list[str]]]:
    base = ["--model-path", str(target)]
    eagle3 = [*base, "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft)]
    eagle = [*base, "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", str(draft)]
    standalone = [*base, "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", str(draft)]
    ngram = [*base, "--speculative-algorithm", "NGRAM"]
    algorithms = {"eagle3": eagle3, "eagle": eagle, "standalone": standalone}
    cases: list[tuple[str, list[str]]] = [
        # The seed's incident: vLLM's flag, then the half-fixed command.
        ("seed-vllm-flag", [*eagle3, "--num-speculative-tokens", "16"]),
        ("seed-draft-tokens-only", [*eagle3, "--speculative-num-draft-tokens", "16"]),
        ("seed-fixed", [*eagle3, *chain(15)]),
        ("plain", base),
        ("no-model-path", ["--port", "30001"]),
    ]
    cases += [(f"eagle3-chain-{s}", [*eagle3, *chain(s)]) for s in (1, 2, 3, 5, 7)]
    cases += [(f"eagle3-tree-{s}-{k}-{n}", [*eagle3, *tree(s, k, n)]) for s, k, n in ((3, 2, 4), (5, 4, 8), (2, 4, 6), (4, 2, 8))]
    cases += [(f"{name}-chain", [*argv, *chain(3)]) for name, argv in algorithms.items()]
    cases += [("ngram-plain", ngram), ("nextn-chain", [*base, "--speculative-algorithm", "NEXTN", *chain(3)])]
    # topk 1 with a different verify width: SGLang rewrites it (a warning, not an error).
    cases += [(f"eagle3-topk1-draft-tokens-{n}", [*eagle3, "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(n)]) for n in (2, 8)]
    # Partial triples (bare AssertionError) and steps without topk (TypeError), per algorithm.
    for name, argv in algorithms.items():
        cases += [
            (f"{name}-topk-only", [*argv, "--speculative-eagle-topk", "1"]),
            (f"{name}-draft-tokens-only", [*argv, "--speculative-num-draft-tokens", "4"]),
            (f"{name}-topk-and-draft-tokens", [*argv, "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]),
            (f"{name}-steps-only", [*argv, "--speculative-num-steps", "3"]),
            (f"{name}-steps-and-draft-tokens", [*argv, "--speculative-num-steps", "3", "--speculative-num-draft-tokens", "4"]),
            (f"{name}-no-triple", argv),
        ]
    cases += [
        ("tree-without-draft-tokens", [*eagle3, "--speculative-num-steps", "3", "--speculative-eagle-topk", "4"]),
        ("tree-capacity-exceeded", [*eagle3, *tree(2, 2, 20)]),
        ("eagle3-without-draft", [*base, "--speculative-algorithm", "EAGLE3", *chain(3)]),
        ("standalone-without-draft", [*base, "--speculative-algorithm", "STANDALONE", *chain(3)]),
        ("draft-path-missing", [*base, "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(target.parent / "no-such-draft"), *chain(3)]),
    ]
    for option in ("--attention-backend", "--decode-attention-backend", "--prefill-attention-backend"):
        cases.append((f"trtllm-mha-tree{option[1:].replace('-attention-backend', '')}", [*eagle3, *tree(3, 2, 4), option, "trtllm_mha"]))
    cases.append(("trtllm-mha-chain", [*eagle3, *chain(3), "--attention-backend", "trtllm_mha"]))
    for backend in ("flashinfer", "fa3", "triton", "torch_native"):
        cases.append((f"page16-tree-{backend}", [*eagle3, *tree(3, 4, 8), "--page-size", "16", "--attention-backend", backend]))
    cases += [
        ("page16-tree-auto-backend", [*eagle3, *tree(3, 4, 8), "--page-size", "16"]),
        ("page16-chain", [*eagle3, *chain(3), "--page-size", "16"]),
        ("ngram-page16", [*ngram, "--page-size", "16"]),
    ]
    # Attention backends with speculative decoding.
    cases += [(f"flex-attention-{name}", [*argv, *chain(3), "--attention-backend", "flex_attention"]) for name, argv in algorithms.items()]
    cases += [
        ("flex-attention-ngram", [*ngram, "--attention-backend", "flex_attention"]),
        ("flex-attention-no-spec", [*base, "--attention-backend", "flex_attention"]),
        ("triton-backend-chain", [*eagle3, *chain(3), "--attention-backend", "triton"]),
        ("torch-native-chain", [*eagle3, *chain(3), "--attention-backend", "torch_native"]),
    ]
    # Parallelism.
    cases += [
        ("pp2-eagle3", [*eagle3, *chain(3), "--pp-size", "2"]),
        ("pp2-no-spec", [*base, "--pp-size", "2"]),
        ("tp2-eagle3", [*eagle3, *chain(3), "--tp-size", "2"]),
        ("dp-attention-eagle3", [*eagle3, *chain(3), "--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"]),
        ("dp-attention-standalone", [*standalone, *chain(3), "--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"]),
        ("dp-attention-ngram", [*ngram, "--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"]),
    ]
    # Adaptive speculative decoding (0.5.10+).
    cases += [
        ("adaptive-eagle3", [*eagle3, "--speculative-adaptive"]),
        ("adaptive-eagle3-chain", [*eagle3, *chain(3), "--speculative-adaptive"]),
        ("adaptive-eagle3-tree", [*eagle3, *tree(3, 2, 4), "--speculative-adaptive"]),
        ("adaptive-eagle3-topk2", [*eagle3, "--speculative-eagle-topk", "2", "--speculative-adaptive"]),
        ("adaptive-standalone", [*standalone, *chain(3), "--speculative-adaptive"]),
        ("adaptive-ngram", [*ngram, "--speculative-adaptive"]),
        ("adaptive-steps-9", [*eagle3, *chain(9), "--speculative-adaptive"]),
        ("adaptive-steps-only", [*eagle3, "--speculative-num-steps", "3", "--speculative-adaptive"]),
    ]
    # Rejection sampling (0.5.23).
    cases += [
        ("rejection-sampling-chain", [*eagle3, *chain(3), "--speculative-use-rejection-sampling"]),
        ("rejection-sampling-tree", [*eagle3, *tree(3, 2, 4), "--speculative-use-rejection-sampling"]),
        ("rejection-sampling-thresholds", [*eagle3, *chain(3), "--speculative-use-rejection-sampling", "--speculative-accept-threshold-single", "0.5"]),
        ("rejection-sampling-standalone", [*standalone, *chain(3), "--speculative-use-rejection-sampling"]),
    ]
    # Draft window / sink (0.5.12+ / 0.5.23) and DFLASH block sizes.
    cases += [
        ("draft-window-8", [*eagle3, *chain(3), "--speculative-draft-window-size", "8"]),
        ("draft-window-0", [*eagle3, *chain(3), "--speculative-draft-window-size", "0"]),
        ("draft-window-below-draft-tokens", [*eagle3, *chain(3), "--speculative-draft-window-size", "2"]),
        ("draft-sink-without-window", [*eagle3, *chain(3), "--speculative-draft-sink-size", "4"]),
        ("draft-sink-negative", [*eagle3, *chain(3), "--speculative-draft-window-size", "8", "--speculative-draft-sink-size", "-1"]),
        ("dflash-block-0", [*base, "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(draft), "--speculative-dflash-block-size", "0"]),
        ("dflash-block-mismatch", [*base, "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(draft), "--speculative-dflash-block-size", "8", "--speculative-num-draft-tokens", "4"]),
    ]
    # Algorithm names.
    cases += [
        ("algorithm-lowercase", [*base, "--speculative-algorithm", "eagle3", "--speculative-draft-model-path", str(draft), *chain(3)]),
        ("algorithm-unknown", [*base, "--speculative-algorithm", "MEDUSA", "--speculative-draft-model-path", str(draft), *chain(3)]),
        ("algorithm-vllm-name", [*base, "--speculative-algorithm", "draft_model", "--speculative-draft-model-path", str(draft), *chain(3)]),
    ]
    # Argument-level mistakes.
    cases += [
        ("unknown-flag", [*eagle3, *chain(3), "--mem-fraction-statik", "0.8"]),
        ("ambiguous-abbreviation", [*eagle3, "--speculative-num", "3"]),
        ("unique-abbreviation", [*eagle3, *chain(3), "--mem-fraction", "0.8"]),
        ("vllm-gpu-memory-utilization", [*eagle3, *chain(3), "--gpu-memory-utilization", "0.8"]),
        ("vllm-max-model-len", [*eagle3, *chain(3), "--max-model-len", "4096"]),
        ("vllm-speculative-config", [*base, "--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 3}']),
        ("vllm-speculative-model", [*base, "--speculative-algorithm", "EAGLE3", "--speculative-model", str(draft), *chain(3)]),
        ("stray-value", [*eagle3, *chain(3), "--trust-remote-code", "true"]),
        ("not-a-number", [*eagle3, *chain(3), "--page-size", "sixteen"]),
        ("bad-choice", [*eagle3, *chain(3), "--attention-backend", "no-such-backend"]),
        ("missing-value", [*eagle3, *chain(3), "--port"]),
        ("duplicate-flag", [*eagle3, *chain(3), "--port", "30001", "--port", "30002"]),
        ("speculative-without-algorithm", [*base, *chain(3)]),
    ]
    # Valid launch options around a chain (what sglang-command emits, and what users add).
    extras = {
        "mem-fraction": ["--mem-fraction-static", "0.8"],
        "dtype-bf16": ["--dtype", "bfloat16"],
        "context-length": ["--context-length", "4096"],
        "max-running-requests": ["--max-running-requests", "64"],
        "chunked-prefill": ["--chunked-prefill-size", "4096"],
        "cuda-graph-max-bs": ["--cuda-graph-max-bs", "32"],
        "disable-cuda-graph": ["--disable-cuda-graph"],
        "host-port": ["--host", "127.0.0.1", "--port", "30001"],
        "trust-remote-code": ["--trust-remote-code"],
        "kv-cache-dtype": ["--kv-cache-dtype", "auto"],
        "inline-values": ["--speculative-num-steps=3", "--page-size=1"],
        "token-map": ["--speculative-token-map", str(target.parent / "no-such-map.pt")],
    }
    cases += [(f"valid-{name}", [*eagle3, *chain(3), *extra]) for name, extra in extras.items()]
    ids = [case_id for case_id, _ in cases]
    assert len(ids) == len(set(ids)), "case ids must be unique"
    return cases
