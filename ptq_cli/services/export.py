"""A .tflite model as C source: the aligned byte array TensorFlow Lite Micro projects compile in."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ptq_cli import backends
from ptq_cli.atomic import check_outputs, write_text
from ptq_cli.backends import litert
from ptq_cli.backends.model_file import read_bytes
from ptq_cli.errors import PtqError

# TFLite Micro reads the flatbuffer in place: 16-byte alignment keeps its tensors' data aligned.
ALIGNMENT = 16
BYTES_PER_LINE = 12


@dataclass(frozen=True)
class CArrayExport:
    model: Path
    source: Path
    header: Path
    symbol: str  # the array; its length is <symbol>_len
    size_bytes: int
    arena_bytes: int | None = None  # the tensor arena TFLite Micro allocated for it (<SYMBOL>_ARENA_BYTES), if measured


# C11's keywords, and names its headers define as macros: a symbol named so does not compile.
C_KEYWORDS = frozenset([
    "auto", "break", "case", "char", "const", "continue", "default", "do", "double", "else", "enum", "extern", "float", "for",
    "goto", "if", "inline", "int", "long", "register", "restrict", "return", "short", "signed", "sizeof", "static", "struct",
    "switch", "typedef", "union", "unsigned", "void", "volatile", "while", "_Alignas", "_Alignof", "_Atomic", "_Bool",
    "_Complex", "_Generic", "_Imaginary", "_Noreturn", "_Static_assert", "_Thread_local", "bool", "true", "false", "NULL", "asm",
])


def c_symbol(name: str) -> str:
    """A C identifier from a file name: resnet8-int8.tflite -> resnet8_int8_tflite."""
    symbol = re.sub(r"[^A-Za-z0-9_]", "_", name)
    return f"model_{symbol}" if symbol[:1].isdigit() else symbol


def measure_arena(model: Path) -> int | None:
    """The tensor arena a microcontroller runtime of the backend table (TFLite Micro) allocates for the model,
    as it measures it; None where none is installed. A model it cannot run is refused in one line."""
    from ptq_cli.services.models import load_model

    rows = [row for row in backends.TABLE.values() if row.microcontroller and row.available()]
    return load_model(model, 1, runtime=rows[0].name).info.arena_bytes if rows else None


def export_c_array(model: Path, output_dir: Path | None = None, symbol: str | None = None, arena: bool = True) -> CArrayExport:
    """Write <model>.c and <model>.h beside the model (or in `output_dir`): the bytes as an aligned
    `const unsigned char` array and its length as `const unsigned int`; with `arena`, the tensor arena TFLite
    Micro measured for it as <SYMBOL>_ARENA_BYTES."""
    model = Path(model)
    data = read_bytes(model)
    if not litert.sniff(data[:8]):
        raise PtqError(f"{model}: not a TFLite flatbuffer; --c-array exports .tflite models (what TFLite Micro runs)")
    symbol = symbol or c_symbol(model.name)
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", symbol) or symbol in C_KEYWORDS or symbol.startswith("__"):
        raise PtqError(f"--symbol: '{symbol}' is not a C identifier a program can declare (a keyword, or reserved)")
    directory = Path(output_dir) if output_dir is not None else model.parent
    source, header = directory / f"{model.stem}.c", directory / f"{model.stem}.h"
    check_outputs([("--output-dir", source, (".c",)), ("--output-dir", header, (".h",))], [model])
    guard = f"{symbol.upper()}_H_"
    arena_bytes = measure_arena(model) if arena else None
    arena_lines = ["/* The tensor arena TensorFlow Lite Micro allocated for it: tflite-micro's recording allocator on the 64-bit host",
                   "   that exported it (not measured on the target). */",
                   f"#define {symbol.upper()}_ARENA_BYTES {arena_bytes}", ""] if arena_bytes else []
    write_text(header, "\n".join([
        f"/* {model.name}: {len(data):,} bytes, written by ptq export --c-array. */",
        f"#ifndef {guard}", f"#define {guard}", "", *arena_lines,
        "#ifdef __cplusplus", 'extern "C" {', "#endif", "",
        f"extern const unsigned char {symbol}[];",
        f"extern const unsigned int {symbol}_len;", "",
        "#ifdef __cplusplus", "}", "#endif", "", f"#endif /* {guard} */", "",
    ]))
    rows = [", ".join(f"0x{byte:02x}" for byte in data[start : start + BYTES_PER_LINE]) for start in range(0, len(data), BYTES_PER_LINE)]
    write_text(source, "\n".join([
        f'#include "{header.name}"', "",
        "#if defined(__cplusplus)", f"alignas({ALIGNMENT})", "#else", f"_Alignas({ALIGNMENT})", "#endif",
        f"const unsigned char {symbol}[] = {{",
        *(f"  {row}," for row in rows),
        "};", "",
        f"const unsigned int {symbol}_len = {len(data)};", "",
    ]))
    return CArrayExport(model, source, header, symbol, len(data), arena_bytes)
