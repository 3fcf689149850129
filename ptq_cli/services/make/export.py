"""A .tflite model as C source: the aligned byte array TensorFlow Lite Micro projects compile in."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ptq_cli import backends
from ptq_cli.backends import litert
from ptq_cli.errors import PtqError
from ptq_cli.guards import bounded
from ptq_cli.guards.atomic import atomic_output, check_outputs

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
    # C23 and C++ (the header is included from C++ too), and names a program already has.
    "alignas", "alignof", "constexpr", "nullptr", "static_assert", "thread_local", "typeof", "typeof_unqual", "_BitInt", "_Decimal32",
    "_Decimal64", "_Decimal128", "and", "and_eq", "bitand", "bitor", "catch", "char8_t", "char16_t", "char32_t", "class", "compl", "concept",
    "consteval", "constinit", "const_cast", "co_await", "co_return", "co_yield", "decltype", "delete", "dynamic_cast", "explicit", "export",
    "friend", "mutable", "namespace", "new", "noexcept", "not", "not_eq", "operator", "or", "or_eq", "private", "protected", "public",
    "reinterpret_cast", "requires", "static_cast", "template", "this", "throw", "try", "typeid", "typename", "using", "virtual", "wchar_t",
    "xor", "xor_eq", "main", "errno", "assert", "stdin", "stdout", "stderr",
])


def valid_symbol(symbol: str) -> bool:
    """A name C and C++ both let a program declare: an identifier, no keyword, none of the reserved forms
    (a leading '_' and capital, '__' anywhere, a leading '_' at file scope)."""
    return (re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", symbol) is not None and symbol not in C_KEYWORDS and "__" not in symbol
            and len(symbol) <= 200)


def c_symbol(name: str) -> str:
    """A valid symbol from a file name, always: resnet8-int8.tflite -> resnet8_int8_tflite, ü.tflite -> tflite,
    class.tflite -> class_tflite, 8bit.tflite -> model_8bit_tflite."""
    symbol = re.sub(r"_+", "_", re.sub(r"[^A-Za-z0-9]", "_", name)).strip("_")[:120].rstrip("_")
    return symbol if valid_symbol(symbol) else f"model_{symbol}".rstrip("_")


def _c_comment(text: str) -> str:
    """Text safe inside /* */: printable ASCII, no comment end."""
    return "".join(character if " " <= character <= "~" else "?" for character in text).replace("*/", "*?")


def measure_arena(model: Path) -> int | None:
    """The tensor arena a microcontroller runtime of the backend table (TFLite Micro) allocates for the model,
    as it measures it; None where none is installed. A model it cannot run is refused in one line."""
    from ptq_cli.services.models import load_model

    rows = [row for row in backends.TABLE.values() if row.runtime.microcontroller and row.available()]
    return load_model(model, 1, runtime=rows[0].name).info.arena_bytes if rows else None


def export_c_array(model: Path, output_dir: Path | None = None, symbol: str | None = None, arena: bool = True) -> CArrayExport:
    """Write <model>.c and <model>.h beside the model (or in `output_dir`): the bytes as an aligned
    `const unsigned char` array and its length as `const unsigned int`; with `arena`, the tensor arena TFLite
    Micro measured for it as <SYMBOL>_ARENA_BYTES."""
    model = Path(model)
    size = bounded.regular_size(model, "model file")
    if size > bounded.C_ARRAY_BYTES.value():
        raise bounded.C_ARRAY_BYTES.refuse(model, f"{size:,} bytes")
    data = bounded.read_bytes(model, bounded.C_ARRAY_BYTES, "model file")
    if not data:
        raise PtqError(f"{model}: empty file")
    if not litert.sniff(data[:8]):
        raise PtqError(f"{model}: not a TFLite flatbuffer; --c-array exports .tflite models (what TFLite Micro runs)")
    if symbol is not None and not valid_symbol(symbol):
        raise PtqError(f"--symbol: '{symbol[:60]}' is not a name C and C++ let a program declare (a letter, then letters, digits "
                       "and single '_'; no keyword, no reserved name)")
    symbol = symbol or c_symbol(model.name)
    directory = Path(output_dir) if output_dir is not None else model.parent
    # The .c includes the .h by name: a name a C string cannot hold as it is gives files named after the symbol.
    stem = model.stem if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", model.stem) else symbol
    source, header = directory / f"{stem}.c", directory / f"{stem}.h"
    check_outputs([("--output-dir", source, (".c",)), ("--output-dir", header, (".h",))], [model])
    guard = f"{symbol.upper()}_H_"
    arena_bytes = measure_arena(model) if arena else None
    arena_lines = ["/* The tensor arena TensorFlow Lite Micro allocated for it: tflite-micro's recording allocator on the 64-bit host",
                   "   that exported it (not measured on the target). */",
                   f"#define {symbol.upper()}_ARENA_BYTES {arena_bytes}", ""] if arena_bytes else []
    header_text = "\n".join([
        f"/* {_c_comment(model.name)}: {len(data):,} bytes, written by ptq export --c-array. */",
        f"#ifndef {guard}", f"#define {guard}", "", *arena_lines,
        "#ifdef __cplusplus", 'extern "C" {', "#endif", "",
        f"extern const unsigned char {symbol}[];",
        f"extern const unsigned int {symbol}_len;", "",
        "#ifdef __cplusplus", "}", "#endif", "", f"#endif /* {guard} */", "",
    ])
    opening = "\n".join([f'#include "{header.name}"', "", "#if defined(__cplusplus)", f"alignas({ALIGNMENT})", "#else",
                         f"_Alignas({ALIGNMENT})", "#endif", f"const unsigned char {symbol}[] = {{", ""])
    closing = "\n".join(["};", "", f"const unsigned int {symbol}_len = {len(data)};", ""])
    # Both or neither: each written to a temporary file, renamed only once both are complete (a full disk leaves no .h alone).
    with atomic_output(source) as source_tmp:
        with source_tmp.open("w", encoding="ascii") as handle:  # in pieces: the text is six times the model's bytes
            handle.write(opening)
            for start in range(0, len(data), BYTES_PER_LINE * 4096):
                piece = data[start : start + BYTES_PER_LINE * 4096]
                handle.write("".join(f"  {', '.join(f'0x{byte:02x}' for byte in piece[at : at + BYTES_PER_LINE])},\n"
                                     for at in range(0, len(piece), BYTES_PER_LINE)))
            handle.write(closing)
        with atomic_output(header) as header_tmp:
            header_tmp.write_text(header_text, encoding="ascii")
    return CArrayExport(model, source, header, symbol, len(data), arena_bytes)
