"""The one place that decides EAGLE-3 aux layer ids: which target states are captured, and what each engine is told.

Inside draftline an aux layer id always means a layer-OUTPUT id: id i is the output of decoder layer i, which HF
returns as `hidden_states[i + 1]` (`hidden_states[0]` is the embedding output). Extraction, training, the reference
engine and every export start from these "capture ids".

Engines read `eagle_config.eagle_aux_hidden_state_layer_ids` in the draft's config.json differently, so the ids
written into an export depend on the engine (and may depend on the target family and the engine version):
- SGLang (srt/models/llama.py `set_eagle3_layers_to_capture`, read in 0.5.6, 0.5.12 and 0.5.23) sets
  `layers_to_capture = [id + 1 for id in ids]` and appends the residual stream *entering* each of those layers:
  it reads layer-output ids, so the written ids are the capture ids. Its default, with no ids, is the inputs of
  layers [2, n//2, n-3].
- vLLM (model_executor/models/llama.py, read in 0.32.0) uses the ids as given for `aux_hidden_state_layers` and
  appends the stream entering layer k, i.e. HF `hidden_states[k]`: written id = capture id + 1. Its default is the
  inputs of layers (2, n//2, n-3) as well.

Both engines capture while walking the layers, so the concatenated feature order is ascending layer order, and
the output of the last layer (id n-1) is never captured: capture ids lie in 0..n-2, strictly ascending.

Rules are registered per (family, engine) and may be limited to engine versions; a family without its own rule
for an engine uses the Llama rule of that engine (most HF decoder-only models inherit Llama's capture loop).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

DEFAULT_FAMILY = "llama"
ENGINES = ("reference", "sglang", "vllm")


class AuxLayerIdError(ValueError):
    """Aux layer ids that an engine would capture differently from what the drafter was (or will be) trained on."""


@dataclass(frozen=True)
class AuxIdRule:
    """How one engine, for one target family (and optionally some versions), reads the exported aux ids.

    written_offset: written id = capture id + written_offset (0 for SGLang's Llama, 1 for vLLM's).
    default_input_layers: layers whose *input* the engine captures when the draft config gives no ids.
    source: the engine file (and versions) the rule was read from.
    """

    engine: str
    family: str
    written_offset: int
    default_input_layers: Callable[[int], list[int]]
    source: str
    versions: Optional[tuple[str, ...]] = None  # None: every version of the engine

    def covers(self, version: Optional[str]) -> bool:
        return self.versions is None or version is None or version in self.versions

    def to_written(self, capture_ids: Sequence[int]) -> list[int]:
        return [int(i) + self.written_offset for i in capture_ids]

    def to_capture(self, written_ids: Sequence[int]) -> list[int]:
        return [int(i) - self.written_offset for i in written_ids]

    def default_capture_ids(self, num_layers: int) -> list[int]:
        return [layer - 1 for layer in self.default_input_layers(num_layers)]


def _llama_default_inputs(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


_RULES: list[AuxIdRule] = []


def register_rule(rule: AuxIdRule) -> None:
    """Add a rule; a later rule for the same (family, engine) and overlapping versions takes precedence."""
    if rule.engine not in ENGINES:
        raise ValueError(f"aux id rule for unknown engine {rule.engine!r}; engines are {list(ENGINES)}")
    _RULES.insert(0, rule)


@dataclass(frozen=True)
class FirstIdOneShiftRule(AuxIdRule):
    """SGLang 0.5.23's DeepSeek-V2 family (srt/models/deepseek_v2.py): ids are shifted by +1 only when the first id
    is 1, else taken as the layers whose input is captured. Layer-output id 0 first cannot be expressed (written as
    input layer 1, it would be shifted to 2)."""

    def to_written(self, capture_ids: Sequence[int]) -> list[int]:
        ids = [int(i) for i in capture_ids]
        if ids and ids[0] == 0:
            raise AuxLayerIdError(
                f"aux layer ids {ids}: {self.source} cannot capture the output of layer 0 first (an id list starting "
                "at 1 is shifted by one, any other is read as input layers); start at layer-output id 1 or later"
            )
        return ids if ids and ids[0] == 1 else [i + 1 for i in ids]

    def to_capture(self, written_ids: Sequence[int]) -> list[int]:
        ids = [int(i) for i in written_ids]
        return ids if ids and ids[0] == 1 else [i - 1 for i in ids]


register_rule(AuxIdRule("sglang", DEFAULT_FAMILY, 0, _llama_default_inputs, "sglang srt/models/llama.py 0.5.6-0.5.23"))
# Per model file, read in 0.5.6, 0.5.12, 0.5.14 (SpecForge 0.2.0's pin) and 0.5.23: qwen3.py and qwen3_moe.py (via
# qwen2_moe's model) shift by +1 like llama.py; deepseek_v2.py (DeepSeek-V2/V3, Kimi-K2, and Kimi-K2.5's language
# model) does until 0.5.12, and from 0.5.14 only a list starting at 1.
for _family in ("qwen3", "qwen3_moe"):
    register_rule(AuxIdRule("sglang", _family, 0, _llama_default_inputs, f"sglang srt/models/{_family}.py 0.5.6-0.5.23"))
for _family in ("deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25"):
    register_rule(AuxIdRule("sglang", _family, 0, _llama_default_inputs, "sglang srt/models/deepseek_v2.py 0.5.6-0.5.12",
                            versions=("0.5.6", "0.5.12")))  # fmt: skip
    register_rule(FirstIdOneShiftRule("sglang", _family, 0, _llama_default_inputs, "sglang srt/models/deepseek_v2.py 0.5.23",
                                      versions=("0.5.14", "0.5.23")))  # fmt: skip
# vLLM 0.32.0: every family appends the stream entering layer k (llama.py and qwen2/qwen3/qwen3_moe through
# interfaces.py's EagleModelMixin, deepseek_v2.py its own loop `if idx in self.aux_hidden_state_layers`).
register_rule(AuxIdRule("vllm", DEFAULT_FAMILY, 1, _llama_default_inputs, "vllm model_executor/models/llama.py 0.32.0"))
# Qwen3 runs Qwen2Model.forward (qwen2.py), the same loop, and SupportsEagle3's default layers (2, n//2, n-3);
# tests/integration/test_aux_layers.py runs both from the installed vLLM.
register_rule(AuxIdRule("vllm", "qwen3", 1, _llama_default_inputs, "vllm model_executor/models/qwen2.py (Qwen3Model) 0.32.0"))
# The reference engine captures exactly what extraction captures (one shared definition in target/capture.py).
register_rule(AuxIdRule("reference", DEFAULT_FAMILY, 0, _llama_default_inputs, "draftline target/capture.py"))


def rule_for(family: str, engine: str, engine_version: Optional[str] = None) -> AuxIdRule:
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}: aux layer ids are known for {list(ENGINES)}")
    for wanted_family in (family, DEFAULT_FAMILY):
        for rule in _RULES:
            if rule.family == wanted_family and rule.engine == engine and rule.covers(engine_version):
                return rule
    raise ValueError(f"no aux id rule for engine {engine!r} version {engine_version!r} (family {family!r})")


def family_of(hf_config: Any) -> str:
    """The target family a transformers config (object or config.json dict) belongs to: its model_type."""
    model_type = hf_config.get("model_type") if isinstance(hf_config, dict) else getattr(hf_config, "model_type", None)
    return str(model_type or DEFAULT_FAMILY)


def default_aux_layer_ids(
    num_layers: int, family: str = DEFAULT_FAMILY, engine: str = "sglang", engine_version: Optional[str] = None
) -> list[int]:
    """The capture ids an engine uses when the draft gives none (Llama in SGLang and vLLM: [1, n//2-1, n-4])."""
    return rule_for(family, engine, engine_version).default_capture_ids(num_layers)


def capture_id_problems(capture_ids: Sequence[int], num_layers: int) -> list[str]:
    """What is wrong with capture (layer-output) ids for an n-layer target; empty when they are fine."""
    ids = list(capture_ids)
    if not ids:
        return ["no aux layer ids: EAGLE-3 needs at least one captured layer"]
    problems = []
    bad = [i for i in ids if not isinstance(i, int) or not 0 <= i <= num_layers - 2]
    if bad:
        problems.append(
            f"ids {bad} are outside 0..{num_layers - 2} for a {num_layers}-layer target (layer-output ids; the engines "
            "capture the input of layer id+1, which must exist)"
        )
    elif ids != sorted(set(ids)):
        problems.append(
            f"ids must be strictly ascending and distinct, because the engines concatenate the captured states in "
            f"layer order; use {sorted(set(ids))}"
        )
    return problems


def check_capture_ids(capture_ids: Sequence[int], num_layers: int, where: str = "aux_layer_ids") -> list[int]:
    """Return the ids as a list, or raise AuxLayerIdError naming `where` (a config field, a file)."""
    problems = capture_id_problems(capture_ids, num_layers)
    if problems:
        raise AuxLayerIdError(f"{where} {list(capture_ids)}: " + "; ".join(problems))
    return [int(i) for i in capture_ids]


@dataclass(frozen=True)
class AuxLayerIds:
    capture: tuple[int, ...]  # layer-output ids: HF hidden_states[i + 1]
    written: tuple[int, ...]  # what this engine must read in eagle_config.eagle_aux_hidden_state_layer_ids
    rule: AuxIdRule


def aux_layer_ids(
    family: str,
    engine: str,
    engine_version: Optional[str],
    num_layers: int,
    configured_ids: Optional[Sequence[int]] = None,
    where: str = "extract.aux_layer_ids",
) -> AuxLayerIds:
    """THE mapping: (target family, engine, engine version, num_layers, configured ids) -> capture and written ids.

    configured_ids are capture ids (e.g. extract.aux_layer_ids, or a trained drafter's ids); None takes the engine's
    default capture for that family. Raises AuxLayerIdError (naming `where`) for ids the engine cannot capture.
    """
    rule = rule_for(family, engine, engine_version)
    if configured_ids is None:
        capture = rule.default_capture_ids(num_layers)
        where = f"the default aux layer ids of {engine} for a {num_layers}-layer {family} target"
    else:
        capture = list(configured_ids)
    capture = check_capture_ids(capture, num_layers, where)
    try:
        written = rule.to_written(capture)
    except AuxLayerIdError as err:
        raise AuxLayerIdError(f"{where}: {err}") from None
    return AuxLayerIds(capture=tuple(capture), written=tuple(written), rule=rule)


def written_aux_ids(family: str, engine: str, engine_version: Optional[str], capture_ids: Sequence[int]) -> list[int]:
    """What an export must list for `engine` so that it captures `capture_ids` (already checked against the target)."""
    return rule_for(family, engine, engine_version).to_written(capture_ids)


def capture_ids_from_written(
    family: str, engine: str, engine_version: Optional[str], num_layers: int, written_ids: Sequence[int], where: str
) -> list[int]:
    """The layer-output ids an engine will capture when a draft config lists `written_ids` (checked)."""
    rule = rule_for(family, engine, engine_version)
    if any(not isinstance(i, int) for i in written_ids):
        raise AuxLayerIdError(f"{where} {list(written_ids)}: ids must be integers")
    capture = rule.to_capture(written_ids)
    problems = capture_id_problems(capture, num_layers)
    if problems:
        raise AuxLayerIdError(
            f"{where} {list(written_ids)} means layer-output ids {capture} to {engine} ({rule.source}): " + "; ".join(problems)
        )
    return capture
