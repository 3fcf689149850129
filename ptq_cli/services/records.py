"""JSON records of dataclasses: written atomically, read back keeping only the fields the class knows
(so a record written by an older or newer ptq still loads), and named by the model file they measured."""

from __future__ import annotations

import hashlib
import json
import math
import os
import types
import typing
from dataclasses import asdict, dataclass, fields, is_dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

from ptq_cli.guards.atomic import is_temporary, write_text
from ptq_cli.settings import MANIFEST_NAME

Record = TypeVar("Record", bound="DataclassInstance")
# Fields renamed since records were first written: an older record still loads.
RENAMED_FIELDS = {"framework": "runtime"}


def finite(value: Any) -> Any:  # noqa: PLR0911  one return per kind of value
    """`value` with NaN and infinities as None (null): JSON has no NaN, and a reader must not see one."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if hasattr(value, "as_dict"):  # a dataclass that gives its stored form (the settings)
        return finite(value.as_dict())
    if is_dataclass(value) and not isinstance(value, type):
        return finite(asdict(value))
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return finite(value.tolist())
    return value


def to_json(value: Any) -> str:
    return json.dumps(finite(value), indent=2, default=str, allow_nan=False)


def write_record(path: Path, record: Any) -> Path:
    write_text(path, to_json(record) + "\n")
    return Path(path)


def from_dict(cls: type[Record], data: dict) -> Record:
    """The record of class `cls` in `data`, each known field checked against its annotation (finite
    numbers, strings, lists of them...): a TypeError names the first field that does not fit."""
    if not isinstance(data, dict):
        raise TypeError(f"a JSON object was expected, found {type(data).__name__}")
    for old, new in RENAMED_FIELDS.items():
        if old in data and new not in data:
            data = {**data, new: data[old]}
    hints, known = _annotations(cls)
    for key in known & data.keys():
        if not _fits(data[key], hints[key]):
            raise TypeError(f"field '{key}' is {json.dumps(data[key])[:40]}, expected {hints[key]}")
    for key, schema in getattr(cls, "NESTED_FIELDS", {}).items():
        _check_nested(key, data.get(key), schema)
    return cls(**{key: value for key, value in data.items() if key in known})


def _check_nested(key: str, value: Any, schema: type) -> None:
    """A field held as a JSON object (`dict` in the record class) checked against the class it was written from:
    each of that class's fields present must fit its annotation (`NESTED_FIELDS` of a record class names them)."""
    if not isinstance(value, dict):
        return
    hints, known = _annotations(schema)
    for name in known & value.keys():
        if not _fits(value[name], hints[name]):
            raise TypeError(f"field '{key}.{name}' is {json.dumps(value[name])[:40]}, expected {hints[name]}")


@cache
def _annotations(cls: type) -> tuple[dict[str, Any], frozenset[str]]:
    """A record class's (or TypedDict's) resolved type hints and field names (resolving them is most of a small record's reading)."""
    hints = typing.get_type_hints(cls)
    return hints, frozenset(field.name for field in fields(cls)) if is_dataclass(cls) else frozenset(hints)


def _fits(value: Any, hint: Any) -> bool:
    return _checker(hint)(value)


@cache
def _checker(hint: Any) -> typing.Callable[[Any], bool]:  # noqa: PLR0911  one return per kind of type hint
    """Whether a value fits `hint`, as a function made once per hint (a record holds thousands of values)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return _anything
    if origin in (typing.Union, types.UnionType):
        options = tuple(_checker(arg) for arg in args)
        return lambda value: any(check(value) for check in options)
    if hint is type(None):
        return lambda value: value is None
    if hint is bool:
        return lambda value: isinstance(value, bool)
    if hint is int:
        return lambda value: isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return lambda value: isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if hint is str:
        return lambda value: isinstance(value, str)
    if hint is dict or origin is dict:
        return lambda value: isinstance(value, dict)
    if hint in (list, tuple) or origin in (list, tuple):
        element = _checker(args[0] if args else Any)
        return lambda value: isinstance(value, list) and all(element(item) for item in value)
    return _anything  # nested records are checked by their own from_dict


def _anything(_value: Any) -> bool:
    return True


def record_files(directory: Path) -> list[Path]:
    """The records in `directory`: its .json files, without the run manifest and unfinished writes."""
    return sorted(path for path in Path(directory).glob("*.json") if path.name != MANIFEST_NAME and not is_temporary(path))


def model_key(model_path: Path | str) -> str:
    """`resnet8.onnx-1a2b3c`: the model's file name and a digest of its folder, so two models of the same
    name in different folders keep their own records. A folder inside the working directory is taken
    relative to it, so a project directory that is moved or copied keeps its record names; one outside it
    (shared assets) by its absolute path, which the copy shares. Inside, the folder is taken as named, links
    not followed: a view of the project made of links (a `ptq run` stage on a worker) names records alike."""
    path = Path(model_path)
    folder = os.path.relpath(os.path.abspath(path.parent), os.getcwd())
    if folder == os.pardir or folder.startswith(os.pardir + os.sep):
        folder = str(path.resolve().parent)
    folder = hashlib.sha256(folder.encode("utf-8", "surrogateescape")).hexdigest()[:6]
    return f"{_within(path.name, NAME_BYTES)}-{folder}"


NAME_BYTES = 120  # of a model's name in a record's file name: with the dataset and runtime parts, under a file system's 255


def _within(name: str, limit: int) -> str:
    """`name`, or its first bytes and a digest of the whole when it is longer than `limit` bytes (a 245-byte
    file name still gets a record)."""
    raw = os.fsencode(name)
    if len(raw) <= limit:
        return name
    kept = name
    while len(os.fsencode(kept)) > limit - 13:  # by characters: a cut inside one would make a name no codec takes
        kept = kept[:-1]
    return kept.rstrip() + "~" + hashlib.sha256(raw).hexdigest()[:12]


@dataclass(frozen=True, order=True)
class MeasurementKey:
    """What a figure was measured on: the model's bytes, the runtime, its precision hint, the x86 int8 path
    and the images (a benchmark's speed is not tied to a dataset: "" there). Records are joined on this,
    never on file names."""

    model_sha256: str
    runtime: str
    precision: str = ""
    int8_path: str = ""
    dataset_sha256: str = ""
    feeding: str = ""  # the preprocessing the images were fed with (feeding_key); "" for a benchmark's speed

    @classmethod
    def of(cls, record: Any, with_dataset: bool = True) -> MeasurementKey:
        """The key of an evaluation or benchmark record (without its dataset: to find its speed)."""
        dataset = (getattr(record, "dataset_sha256", "") or getattr(record, "dataset", "")) if with_dataset else ""
        int8_path = (getattr(record, "int8_path", None) or "") if with_dataset else ""
        feeding = feeding_key(getattr(record, "preprocessing_settings", None)) if with_dataset else ""
        return cls(record.model_sha256, record.runtime, record.precision or "", int8_path, dataset, feeding)


def feeding_key(preprocessing_settings: dict | None) -> str:
    """What the images were fed as (scale, mean, std, channel order, size; not the preset's name), as a short digest:
    two measurements compare only if theirs are equal. A record that names none was fed as Preprocessing's defaults."""
    from ptq_cli.inputs import Preprocessing

    stored = {**asdict(Preprocessing()), **(preprocessing_settings or {})}
    values = [round(float(stored["scale"]), 9), [round(float(value), 9) for value in stored["mean"]],
              [round(float(value), 9) for value in stored["std"]], bool(stored["bgr"]), list(stored["size"] or [])]
    return hashlib.sha256(json.dumps(values).encode()).hexdigest()[:12]


DEFAULT_FEEDING = feeding_key(None)


def same_feeding(one: Any, other: Any) -> bool:
    """Whether two evaluation records' images were fed alike: the only records a delta may be taken between."""
    return feeding_key(getattr(one, "preprocessing_settings", None)) == feeding_key(getattr(other, "preprocessing_settings", None))
