"""JSON records of dataclasses: written atomically, read back keeping only the fields the class knows
(so a record written by an older or newer ptq still loads)."""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, TypeVar

from ptq_cli.atomic import write_text

Record = TypeVar("Record")


def write_record(path: Path, record: Any) -> Path:
    write_text(path, json.dumps(asdict(record), indent=2, default=str) + "\n")
    return Path(path)


def from_dict(cls: type[Record], data: dict) -> Record:
    known = {field.name for field in fields(cls)}
    return cls(**{key: value for key, value in data.items() if key in known})
