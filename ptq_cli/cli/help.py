"""`--help` that fits a screen: the options a first run needs, each in its first sentence; `--help-all` shows every
option with its whole text (what the generated CLI reference holds too)."""

from __future__ import annotations

import re
from typing import Any

from typer.core import TyperOption

from ptq_cli import backends

HELP_ALL = "--help-all"

# Options a first run does not need, shown by --help-all: knobs of the algorithms, where records go, how work is spread.
ADVANCED = frozenset({
    "weight_dtype", "percentile", "graph_preprocess", "overflow_fix", "stem", "rounding", "portability_cost", "results_dir",
    "calibration_data", "calibration", "seed", "samples_per_class", "emulated_images", "kernel_path", "precision",
})
# Whole panels a first run does not need: each backend's own options, and the workers.
ADVANCED_PANELS = frozenset({"Workers"})

# Where an option's first sentence does not say what it is for: by name, or by command and name.
SHORT = {
    "quantize.backend": "Where the model will run: " + ", ".join(backends.quantizers()) + f" ({HELP_ALL}: what each does).",
    "quantize.target": "speed: the fast x86 configuration (onnxruntime: uint8 activations, int8 per-channel weights).",
    "method": "Activation calibration, the backend's own; auto judges several on held-out calibration images.",
    "cpus": "all: right on every x86 CPU, with or without VNNI, and ARM; vnni: the full 8-bit range for VNNI/AMX and ARM only.",
    "per_channel": "One weight scale per output channel, or one per tensor. (default: the backend's)",
    "data": "Images: CIFAR-10 python batches, an image folder (ROOT/<class>/*.jpg, ROOT/*.jpg) or an .npz.",
    "preprocess": "The model's input normalisation: raw255, unit (x1/255), imagenet or cifar10-normalized.",
    "quantize.model": "The FP32 ONNX model to quantize.",
    "dtype": "Activation and weight type.",
    "quantize.time_budget": "Seconds the quantization may take: the optional steps that do not fit are left out, and said. (default: none)",
}

_DEFAULT = re.compile(r"\s*\((?:default|env)[^()]*(?:\([^()]*\)[^()]*)*\)\s*$")


def short_help(text: str, name: str = "", command: str = "") -> str:
    """An option's help in a sentence: its own short form (SHORT), else the first sentence (up to a semicolon) without
    long asides, with its "(default: ...)" when that is short."""
    default = _DEFAULT.search(text)
    body = text[: default.start()] if default else text
    own = SHORT.get(f"{command}.{name}", SHORT.get(name))
    if own is not None:
        first = own
    else:
        end = re.search(r"(?<=[a-z0-9)\]])(\.(?=\s+[A-Z(]|\s*$)|;)", body)
        first = re.sub(r" \([^()]{30,}\)", "", body[: end.start()] if end else body).rstrip(".:,; ") + "."
    if default and len(default.group().strip()) <= 40 and "(default" not in first:
        first += " " + default.group().strip()
    return first


def _advanced(param: Any) -> bool:
    panels = ADVANCED_PANELS | {row.quantizer.options.panel for row in backends.TABLE.values() if row.quantizer is not None}
    return param.name in ADVANCED or getattr(param, "rich_help_panel", None) in panels


def asked_for_all(args: list[str]) -> tuple[list[str], bool]:
    """(the arguments with --help-all as --help, whether it was given)."""
    return [("--help" if arg == HELP_ALL else arg) for arg in args], HELP_ALL in args


def may_show_help(args: list[str]) -> bool:
    """Whether these arguments can show a command's options: --help, or no command (the app's own help)."""
    return "--help" in args or len(args) == 0


def fit(group: Any, show_all: bool = False) -> None:
    """Each command's options as its help shows them: all of them with their whole text, or the common ones in a
    sentence each (the full text kept on the option, set back by the next call)."""
    for name, command in getattr(group, "commands", {}).items():
        hides = False
        for param in command.params:
            if not isinstance(param, TyperOption):
                continue
            if not hasattr(param, "ptq_full_help"):
                param.ptq_full_help = param.help or ""
            param.help = param.ptq_full_help if show_all else short_help(param.ptq_full_help, param.name or "", name)
            param.hidden = not show_all and _advanced(param)
            hides = hides or param.hidden or param.help != param.ptq_full_help
        command.epilog = f"Every option, each with its whole text: ptq {name} {HELP_ALL}" if hides else None
