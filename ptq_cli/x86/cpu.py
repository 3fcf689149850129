"""The CPU ptq runs on, and which of the two x86 int8 paths its kernels take.

Without VNNI, x86 u8 x s8 kernels (onnxruntime's MLAS, PyTorch's fbgemm) multiply with `vpmaddubsw`, which
adds each pair of u8 x s8 products into a saturating int16: the *saturating* path. With AVX512-VNNI,
AVX-VNNI or AMX the products accumulate in int32: the *exact* path. ARM kernels widen too (exact).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TypedDict

from ptq_cli.errors import PtqError
from ptq_cli.guards import bounded

EXACT, SATURATING = "exact", "saturating"
INT8_PATHS = (EXACT, SATURATING)
# The /proc/cpuinfo flags that decide the int8 path, recorded with every figure.
INT8_FLAGS = ("avx2", "avx512_vnni", "avx_vnni", "amx_int8")
VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
CPUINFO = Path("/proc/cpuinfo")
# Read another cpuinfo file instead (tests, and a study rehearsed as another kind of CPU would run it).
CPUINFO_ENV = "PTQ_CPUINFO"
CPUINFO_LIMIT = 1 << 20  # the first processor's block is all ptq reads; never the whole file unbounded

# Which CPUs an 8-bit model is for (`--cpus`): stored in the model, shown by the report.
ALL, VNNI = "all", "vnni"
CPU_TARGETS = {
    ALL: "every x86 CPU, with or without VNNI/AMX, and ARM",
    VNNI: "x86 CPUs with VNNI or AMX, and ARM (full 8-bit range; loses accuracy on AVX2-only CPUs)",
}


@dataclass(frozen=True)
class Cpu:
    model: str
    arch: str  # platform.machine(): x86_64, aarch64, ...
    flags: tuple[str, ...]  # those of INT8_FLAGS it has

    @property
    def int8_path(self) -> str:
        if not self.arch.lower().startswith(("x86", "amd64", "i686")):
            return EXACT
        return EXACT if any(flag in self.flags for flag in VNNI_FLAGS) else SATURATING

    @property
    def exact_int8(self) -> bool:
        """Whether its u8 x s8 int8 kernels are exact (VNNI, AMX, ARM); else they saturate (AVX2)."""
        return self.int8_path == EXACT

    def describe(self) -> str:
        """e.g. "AMD EPYC (avx2; saturating int8 path)"."""
        return f"{describe_record(self.as_record())[:-1]}; {self.int8_path} int8 path)"

    def as_record(self) -> dict:
        return {"model": self.model, "arch": self.arch, "flags": list(self.flags), "int8_path": self.int8_path}


class CpuRecord(TypedDict, total=False):
    """A CPU as records hold it (Cpu.as_record): the schema a record's `cpu` field is checked against."""

    model: str
    arch: str
    flags: list[str]
    int8_path: str | None


def describe_record(cpu: dict | None) -> str:
    """A CPU as records hold it (Cpu.as_record), e.g. "AMD EPYC (avx2)"; "" when a record names none."""
    if not cpu:
        return ""
    return f"{cpu.get('model', '?')} ({', '.join(cpu.get('flags') or []) or 'no avx2'})"


def parse_cpuinfo(text: str, arch: str) -> Cpu:
    """The first processor's model name and int8 flags from /proc/cpuinfo's text."""
    model, flags = "", set[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "hardware", "cpu model") and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
        if not line.strip() and model and flags:
            break
    return Cpu(model or arch or "unknown CPU", arch, tuple(flag for flag in INT8_FLAGS if flag in flags))


@lru_cache(maxsize=1)
def current() -> Cpu:
    """This CPU (or the one PTQ_CPUINFO describes). On x86 its int8 path decides figures, so a description ptq
    cannot read is an error, never a guess: a FIFO or device is refused before it is opened (it could block)."""
    arch = platform.machine()
    named = os.environ.get(CPUINFO_ENV)
    path = Path(named or CPUINFO)
    where = f"{CPUINFO_ENV}={named}" if named else str(path)
    try:
        if named and not path.is_file():
            raise PtqError(f"{where}: not a regular file" + ("" if path.exists() else " (not found)") + "; name a cpuinfo file")
        with bounded.open_regular(path, "cpuinfo file") as handle:  # a file that would wait for data is refused, not waited on
            raw = handle.read(CPUINFO_LIMIT)
        if raw is None:
            raise BlockingIOError
        text = raw.decode("utf-8", errors="replace")
    except BlockingIOError:
        raise PtqError(f"{where}: waits for data when read, not a cpuinfo file; ptq cannot tell this CPU's int8 path") from None
    except PtqError as error:
        raise PtqError(f"{where}: {str(error).partition(': ')[2]}; ptq cannot tell this CPU's int8 path") from None
    except OSError as error:
        raise PtqError(f"{where}: cannot read ({error.strerror or error}); ptq cannot tell this CPU's int8 path") from error
    x86 = arch.lower() in ("x86_64", "amd64", "i686", "i386", "x86")
    if (named or x86) and not any(line.partition(":")[0].strip().lower() in ("flags", "features") for line in text.splitlines()):
        raise PtqError(f"{where}: no 'flags' line, not a cpuinfo file; ptq cannot tell this CPU's int8 path")
    return parse_cpuinfo(text, arch)


def covers(target: str | None, cpu: Cpu) -> bool:
    """Whether a model made for `target` CPUs is meant to run on `cpu` (None: a model ptq did not target)."""
    return target in (None, ALL) or cpu.int8_path == EXACT
