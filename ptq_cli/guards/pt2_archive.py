"""torch.export archives (`.pt2`) read without running anything written in them.

`torch.export.load` warns "never load data from an untrusted source", and a crafted archive can run code in four
places: weights and constants it unpickles (`torch.load(weights_only=False)`, `pickle.loads`), shape expressions it
parses with `sympy.sympify` (which evaluates Python), guard code it compiles into the module (`guards_code`), and node
targets resolved as attribute paths from the `torch` module (`torch.os.system` is one, called when the program runs);
an AOTInductor member is a shared library it loads. Here the archive's JSON is checked first: every node target is a
PyTorch operator (`torch.ops.<namespace>.<op>`) of the namespaces a classifier uses, or one of the `operator`/`math`
functions export writes; shape expressions are arithmetic on symbols; guards compare input sizes; no AOTInductor member,
no custom objects. Then torchs own reader loads it with every unpickling weights-only and any other unpickling refused.
"""

from __future__ import annotations

import contextlib
import io
import re
import types
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ptq_cli.errors import PtqError, first_line
from ptq_cli.guards import bounded
from ptq_cli.guards.library_noise import torchao_pt2e_imported

# The operator namespaces a quantized or float classifier's program holds.
NAMESPACES = frozenset({"aten", "prims", "quantized_decomposed", "torchao", "higher_order"})
_OPERATOR = re.compile(r"^torch\.ops\.(?P<namespace>[A-Za-z_]\w*)\.[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?$")
# What export writes for symbolic sizes (torch.fx's sym ops): by name, nothing else from those modules.
PYTHON_FUNCTIONS = frozenset({
    *(f"_operator.{name}" for name in ("getitem", "add", "sub", "mul", "floordiv", "truediv", "mod", "neg", "pow", "eq", "ne", "lt", "le",
                                       "gt", "ge", "and_", "or_", "not_")),
    "math.ceil", "math.floor", "math.trunc", "math.sqrt",
    "torch.sym_float", "torch.sym_int", "torch.sym_max", "torch.sym_min", "torch.sym_not", "torch.sym_ite", "torch.sym_sum",
    "torch._sym_sqrt", "torch.sym_sqrt",
})
# Shape expressions: sympy's arithmetic on symbols (s0, u1, ...), as export prints them.
_EXPRESSION_NAMES = frozenset({
    "Symbol", "Integer", "Rational", "Float", "Max", "Min", "Mod", "Abs", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "And", "Or", "Not",
    "True", "False", "oo", "positive", "integer", "nonnegative", "real", "finite", "FloorDiv", "ModularIndexing", "Where",
    "PythonMod", "CleanDiv", "CeilToInt", "FloorToInt", "CeilDiv", "LShift", "RShift", "PowByNatural", "FloatPow", "FloatTrueDiv",
    "IntTrueDiv", "IsNonOverlappingAndDenseIndicator", "TruncToFloat", "TruncToInt", "RoundToInt", "RoundDecimal", "ToFloat", "Identity",
})
_EXPRESSION_TOKEN = re.compile(r"\s+|'[a-z]+\d+'|[A-Za-z_]\w*|\d+(?:\.\d+)?(?:e[+-]?\d+)?|[-+*/%(),=<>!&|~^]")
_SYMBOL = re.compile(r"^[a-z]+\d+$")
# A guard compares an input's sizes: L['x'].size()[0] >= 2, and the like.
_GUARD = re.compile(r"^(?:\s|L\['\w+'\](?:\[\d+\])*|\.size\(\)|\[\d+\]|\d+|==|!=|<=|>=|<|>|\+|-|\*|//|%|\(|\)|and|or|not)+$")
AOTINDUCTOR_MEMBER = "data/aotinductor/"


def _expression_ok(text: str) -> bool:
    position = 0
    while position < len(text):
        token = _EXPRESSION_TOKEN.match(text, position)
        if token is None:
            return False
        word = token.group()
        if (word[0].isalpha() or word[0] == "_") and word not in _EXPRESSION_NAMES and not _SYMBOL.match(word):
            return False
        position = token.end()
    return True


def _target_ok(target: str) -> bool:
    operator = _OPERATOR.match(target)
    return target in PYTHON_FUNCTIONS or (operator is not None and operator.group("namespace") in NAMESPACES)


def _walk(value: Any) -> Iterator[tuple[str, Any, dict]]:
    """(key, value, the dict holding it) for every key of every dict in a JSON value, iteratively (no recursion limit)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, child in item.items():
                yield key, child, item
                stack.append(child)
        elif isinstance(item, list):
            stack.extend(item)


def _vet_program(path: Path, member: str, program: Any) -> None:
    if not isinstance(program, dict) or "graph_module" not in program:
        raise PtqError(f"{path}: {member} is not a torch.export program")
    for guard in program.get("guards_code") or []:
        if not isinstance(guard, str) or not _GUARD.match(guard):
            raise PtqError(f"{path}: holds guard code that is not a comparison of input sizes ({str(guard)[:80]!r}); refused")
    for key, value, holder in _walk(program):
        if key == "target" and "inputs" in holder and not (isinstance(value, str) and _target_ok(value)):
            raise PtqError(f"{path}: calls {str(value)[:80]!r}, which is not a PyTorch operator; refused")
        if key == "expr_str" and not (isinstance(value, str) and _expression_ok(value)):
            raise PtqError(f"{path}: holds a shape expression that is not arithmetic on sizes ({str(value)[:80]!r}); refused")
        if key in ("custom_obj_values", "custom_obj") and value:
            raise PtqError(f"{path}: holds custom (TorchScript) objects, whose loading runs code; refused")


def vet(path: Path, data: bytes) -> None:
    """Refuse an archive anything of which would run when loaded or called (see the module's description)."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        members = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError) as error:
        raise PtqError(f"{path}: not a torch.export archive ({first_line(error)})") from error
    bounded.check_count(path, len(members), bounded.ARCHIVE_MEMBERS, f"{len(members):,} members")
    unpacked = sum(member.file_size for member in members)
    if unpacked > bounded.MODEL_BYTES.value():
        raise bounded.MODEL_BYTES.refuse(path, f"{unpacked:,} bytes unpacked")
    programs = 0
    for member in members:
        name = member.filename
        if name.startswith("/") or ".." in name.split("/"):
            raise PtqError(f"{path}: a member's name leaves the archive ({name!r}); refused")
        inside = name.split("/", 1)[-1]
        if inside.startswith(AOTINDUCTOR_MEMBER):
            raise PtqError(f"{path}: holds an AOTInductor shared library ({name}), which would run as native code; refused")
        if inside.startswith("models/") and name.endswith(".json"):
            _vet_program(path, name, bounded.json_loads(archive.read(member)))
            programs += 1
    if programs == 0:
        raise PtqError(f"{path}: holds no torch.export program (models/*.json)")


def _refused(*_args: Any, **_kwargs: Any) -> Any:
    raise PtqError("holds pickled objects other than tensors")


@contextlib.contextmanager
def _weights_only() -> Iterator[None]:
    """torch.load weights-only whatever its caller asks, and the archive reader's other unpicklers refused."""
    import torch
    from torch.export.pt2_archive import _package

    original = torch.load

    def tensors_only(*args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        return original(*args, **kwargs)

    pickle_stand_in = types.SimpleNamespace(loads=_refused, load=_refused)
    with contextlib.ExitStack() as stack:
        for owner, name, value in ((torch, "load", tensors_only), (_package, "pickle", pickle_stand_in), (torch._C, "_pickle_load_obj", _refused)):
            before = getattr(owner, name)
            setattr(owner, name, value)
            stack.callback(setattr, owner, name, before)
        yield


def load(path: Path, data: bytes) -> tuple[Any, dict[str, str]]:
    """(the archive's ExportedProgram, its extra files), once vetted, read by torch's own reader with tensors only
    unpickled."""
    from torch.export.pt2_archive._package import load_pt2

    torchao_pt2e_imported()  # registers the quantized_decomposed operators programs call

    vet(path, data)
    try:
        with _weights_only():
            contents = load_pt2(io.BytesIO(data))
    except PtqError as error:
        raise PtqError(f"{path}: {error}; refused") from error
    except Exception as error:  # torch raises RuntimeError, ValueError, KeyError... for a damaged archive
        raise PtqError(f"{path}: not a loadable torch.export archive ({first_line(error)})") from error
    programs = contents.exported_programs
    if "model" not in programs:
        raise PtqError(f"{path}: holds no program named 'model' (torch.export.save writes one)")
    extra = {name: value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value) for name, value in contents.extra_files.items()}
    return programs["model"], extra
