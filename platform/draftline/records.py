"""What crosses a boundary between stages, or from a driver into its workers: typed records (docs/architecture.md).

A pipeline stage hands the stages after it one dataclass per stage.

A record class mixes in `StageRecord`: `to_dict()` writes it as the `outputs` of its stage record file
(`<data_dir>/pipeline/<config>/stages/<stage>.json`) and `from_dict()` reads it back, checking every field against
the class's annotations. Values are neither converted nor reordered (a `Path` field is written as its string):
the pipeline hashes an upstream stage's dict into the skip key of the stages after it, so a record read from an
older file must give back exactly the dict that was written.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, Mapping, TypeVar, Union

# Field metadata: a field left out of the dict when it is None (a key only one variant of a stage writes).
OMIT_IF_NONE = "omit_if_none"

R = TypeVar("R", bound="StageRecord")
J = TypeVar("J", bound="WorkerJob")


class RecordError(ValueError):
    """A stage record's outputs do not match its class: names the stage, the field and the file."""


def written_if_set(default: Any = None) -> Any:
    """A field written only when it is not None; reading a dict without it gives None."""
    return dataclasses.field(default=default, metadata={OMIT_IF_NONE: True})


class StageRecord:
    """Mixin for a stage's output record (a dataclass); STAGE is the pipeline stage that writes it."""

    STAGE: ClassVar[str]

    def to_dict(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)
                if not (f.metadata.get(OMIT_IF_NONE) and getattr(self, f.name) is None)}

    @classmethod
    def from_dict(cls: type[R], data: Any, source: Union[str, Path]) -> R:
        """`source`: the file the dict was read from, for the error."""
        return _read_dataclass(cls, data, f"{cls.STAGE} stage record {source}", "outputs", cls.STAGE)


class WorkerJob:
    """Mixin for the one record a driver hands its Ray Train workers: `train_loop_config` holds it under KEY."""

    KEY: ClassVar[str]

    def to_loop_config(self) -> dict:
        return {self.KEY: self}

    @classmethod
    def from_loop_config(cls: type[J], loop_config: dict) -> J:
        job = loop_config.get(cls.KEY)
        if not isinstance(job, cls):
            raise TypeError(f"train_loop_config holds {sorted(loop_config)}, not the {cls.__name__} under {cls.KEY!r}: "
                            f"start the workers with {cls.__name__}.to_loop_config()")
        return job


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _fail(where: str, path: str, problem: str, stage: str) -> RecordError:
    return RecordError(
        f"{where}: {path} {problem}. The file was written by another draftline version or edited by hand: "
        f"rerun the stage with `draftline run CONFIG --from {stage}`"
    )


def _read_dataclass(cls: type, data: Any, where: str, path: str, stage: str) -> Any:
    if not isinstance(data, Mapping):
        raise _fail(where, path, f"is {type(data).__name__}, expected a mapping of {cls.__name__}'s fields", stage)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise _fail(where, path, f"has unknown field(s) {unknown}; {cls.__name__} has {sorted(fields)}", stage)
    values = {}
    for name, field in fields.items():
        if name not in data:
            if field.metadata.get(OMIT_IF_NONE):
                continue
            raise _fail(where, f"{path}.{name}", "is missing", stage)
        values[name] = _read_value(hints[name], data[name], where, f"{path}.{name}", stage)
    return cls(**values)


def _read_value(annotation: Any, value: Any, where: str, path: str, stage: str) -> Any:
    """`value` as `annotation` says, unchanged except a str for a Path; RecordError if it is not one."""
    if annotation is Any:
        return value
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # Optional[X]: X's own error says what is wrong inside it
            return _read_value(options[0], value, where, path, stage)
        for option in options:
            try:
                return _read_value(option, value, where, path, stage)
            except RecordError:
                continue
        raise _fail(where, path, f"is {value!r}, expected {_name(annotation)}", stage)
    if dataclasses.is_dataclass(annotation):
        return _read_dataclass(annotation, value, where, path, stage)
    if origin in (dict, list) or annotation in (dict, list):
        kind = origin or annotation
        if not isinstance(value, kind):
            raise _fail(where, path, f"is {value!r}, expected {_name(annotation)}", stage)
        if not args:
            return value
        if kind is list:
            return [_read_value(args[0], v, where, f"{path}[{i}]", stage) for i, v in enumerate(value)]
        return {k: _read_value(args[1], v, where, f"{path}.{k}", stage) for k, v in value.items()}
    if annotation is Path:
        if not isinstance(value, str):
            raise _fail(where, path, f"is {value!r}, expected a path (str)", stage)
        return Path(value)
    if _is(annotation, value):
        return value
    raise _fail(where, path, f"is {value!r}, expected {_name(annotation)}", stage)


def _is(annotation: type, value: Any) -> bool:
    if annotation is float:  # JSON writes a whole float (2048.0) as it was given: an int is a float too
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, annotation)


def _name(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")
