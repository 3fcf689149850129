"""PyTorch 2 export (`--backend pt2e`): torchao's PT2E quantization of the ONNX model (converted by onnx2torch, then
torch.export), written as a torch.export program (`.pt2`) that plain torch loads, and run on oneDNN's x86 int8 kernels
after Inductor's x86 lowering (quantize/pt2e.py). Loading a `.pt2` runs nothing written in the file
(guards/pt2_archive.py), so no `--trust-remote-code` is asked."""

from __future__ import annotations

import hashlib
import io
import json
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from ptq_cli import inputs
from ptq_cli.backends import base
from ptq_cli.backends.base import Backend, LoadedModel, Quantizer, RunOptions, Runtime, describe_settings, finish_load
from ptq_cli.errors import PtqError
from ptq_cli.guards import bounded, pt2_archive
from ptq_cli.guards.atomic import atomic_output
from ptq_cli.model_file import in_fixed_batches, metadata_object, model_input, read_bytes, resolve_threads
from ptq_cli.quantize import overflow, pt2e
from ptq_cli.quantize.carried import carried_for, carried_note
from ptq_cli.quantize.settings import ProgressCallback, QuantizeCall, QuantizedFile
from ptq_cli.x86 import paths as int8_paths

NAME = "pt2e"
SUFFIX = ".pt2"
METADATA_FILE = "ptq.json"  # ptq's metadata, an extra file of the archive: the same keys as in ONNX metadata
MODEL_INPUT_KEY = "ptq.model_input"
CHUNK = pt2e.CHUNK  # images a call: a large batch runs in chunks whose activations stay in cache


def sniff(_head: bytes) -> bool:
    return False  # a zip archive, as TorchScript's: told apart by its suffix


def _gated(program, recipe: pt2e.Recipe, source: pt2e.TorchSource,
           progress: ProgressCallback | None) -> tuple[object, pt2e.Recipe, pt2e.LoweringJudgement, list[str]]:
    """The converted module whose compiled form keeps its fidelity (pt2e.LoweringJudgement) on held-out calibration
    images: as asked, else with the fully-connected layers in float; else refused."""
    notes: list[str] = []
    for attempt in (recipe, replace(recipe, float_linears=True)):
        converted = pt2e.calibrated(program, attempt, source.batches, progress)
        judged = pt2e.judge_lowering(source.module, converted, pt2e.compiled(converted), source.judged, source.per_call)
        if judged.kept:
            return converted, attempt, judged, notes
        notes.append(f"x86 lowering {'with fully-connected layers in float ' if attempt.float_linears else ''}changed the outputs ({judged.describe()})")
    raise PtqError(f"torchao's x86 lowering changes what the quantized model computes ({'; '.join(notes)}); no model written")


def save_program(program, path: Path, stored: dict[str, str], described: inputs.ModelInput) -> None:
    """A torch.export program saved (torch.export.save), ptq's metadata and the input contract beside it: plain
    `torch.export.load` runs it."""
    import torch

    contents = {**stored, MODEL_INPUT_KEY: json.dumps(asdict(described))}
    buffer = io.BytesIO()
    torch.export.save(program, buffer, extra_files={METADATA_FILE: json.dumps(contents, sort_keys=True)})
    Path(path).write_bytes(buffer.getvalue())


def quantize(call: QuantizeCall) -> QuantizedFile:
    """ONNX -> onnx2torch -> torch.export -> prepare_pt2e (X86InductorQuantizer) -> calibrate -> convert_pt2e, the
    lowering judged, saved with torch.export.save."""
    model, settings, calibration, stored, progress = call.model, call.settings, call.calibration, call.stored, call.progress
    source = pt2e.torch_source(model, calibration, fold=settings.preprocess)
    described, fixed, judged, example = source.described, source.fixed_batch, source.judged, source.example
    module, carried = carried_for(source.module, settings.options, stored.get(base.SOURCE_METADATA_KEY), call.make_weights,
                                  settings.overflow_fix == overflow.ALL_LAYERS)
    program = pt2e.export(module, example, fixed is not None)
    recipe = pt2e.Recipe(per_channel=bool(settings.per_channel), method=settings.method,
                         pair_safe=settings.overflow_fix == overflow.ALL_LAYERS, depthwise=pt2e.depthwise_modules(source.module), carried=carried)
    converted, recipe, lowering, notes = _gated(program, recipe, source, progress)
    extra = bounded.json_loads(stored.pop(base.QUANTIZATION_METADATA_KEY, "{}"))
    contents = {**stored, base.QUANTIZATION_METADATA_KEY: json.dumps({**settings.as_dict(), **extra, "float_linears": recipe.float_linears})}
    with atomic_output(call.output) as tmp:
        # A fixed batch made symbolic is exported open: the program runs any batch, and says so.
        save_program(pt2e.export(converted, example, fixed is not None), tmp, contents, described if fixed is not None else replace(described, batch=None))
        size = tmp.stat().st_size
    notes += [*carried_note(carried), f"output SQNR against FP32 on {len(judged)} calibration images: {lowering.lowered_db:.1f} dB (compiled for x86; "
              f"{lowering.program_db:.1f} dB before, {lowering.against_program_db:.1f} dB between the two)"]
    if recipe.float_linears:
        notes.append("fully-connected layers kept in float: torchao's x86 lowering of them changed the outputs")
    if described.batch is not None and fixed is None:
        notes.append("fixed batch made symbolic (same outputs)")
    return QuantizedFile(size, (), tuple(notes), settings=settings)


def _described(path: Path, program, stored: dict[str, str]) -> inputs.ModelInput:
    """The input contract ptq stored, else read from the program's input: its shape, a free batch symbolic."""
    if MODEL_INPUT_KEY in stored:
        try:
            return inputs.ModelInput(**bounded.json_loads(stored[MODEL_INPUT_KEY]))
        except (ValueError, TypeError):
            pass
    placeholders = [node for node in program.graph.nodes if node.op == "placeholder" and node.name in program.graph_signature.user_inputs]
    if len(placeholders) != 1 or "val" not in placeholders[0].meta:
        raise PtqError(f"{path}: takes {len(placeholders)} inputs, not one image batch")
    shape = [dim if isinstance(dim, int) else None for dim in placeholders[0].meta["val"].shape]
    return model_input(path, placeholders[0].name, shape)


class _Runner:
    """A program as evaluate and benchmark call it: a float one eagerly, a quantized one compiled for x86, which
    compiles once for each batch size: a size met for the first time runs padded to one compiled already (a split's
    last, partial batch), a size met again is compiled (a benchmark's batches)."""

    def __init__(self, path: Path, program, described: inputs.ModelInput, quantized: bool) -> None:
        self.path, self.described, self.quantized = path, described, quantized
        self.module = pt2e.compiled(program.module()) if quantized else program.module()
        self.compiled_sizes: set[int] = set()
        self.seen_sizes: set[int] = set()
        self.compile_seconds: float | None = None
        if quantized:  # compiled now for its usual batch, the time said apart from the throughput
            started = time.perf_counter()
            self.call(np.zeros(described.shape(described.batch or CHUNK), np.float32))
            self.compile_seconds = time.perf_counter() - started
            self.compiled_sizes.add(described.batch or CHUNK)

    def call(self, batch: np.ndarray) -> np.ndarray:
        import torch

        with torch.inference_mode():
            result = self.module(torch.from_numpy(batch))
        result = result[0] if isinstance(result, (tuple, list)) and result else result
        if not isinstance(result, torch.Tensor):
            raise PtqError(f"{self.path}: returns {type(result).__name__}, not a tensor of class scores")
        return result.float().numpy()

    def _chunk(self, chunk: np.ndarray) -> np.ndarray:
        fits = [size for size in self.compiled_sizes if size > len(chunk)]
        if self.quantized and len(chunk) not in self.compiled_sizes and fits and len(chunk) not in self.seen_sizes:
            self.seen_sizes.add(len(chunk))
            padding = np.zeros((min(fits) - len(chunk), *chunk.shape[1:]), chunk.dtype)
            return self.call(np.concatenate([chunk, padding]))[: len(chunk)]
        if self.quantized:
            self.compiled_sizes.add(len(chunk))
        return self.call(chunk)

    def predict(self, batch: np.ndarray) -> np.ndarray:
        if self.described.batch is not None:
            return in_fixed_batches(self.call, batch, self.described.batch)
        if len(batch) == 1:  # one image (latency), at its own size
            return self.call(batch)
        return np.concatenate([self._chunk(batch[start : start + CHUNK]) for start in range(0, len(batch), CHUNK)])


def load(path: Path, options: RunOptions) -> LoadedModel:
    import torch

    path = Path(path)
    data = read_bytes(path)
    program, extra_files = pt2_archive.load(path, data)
    stored = bounded.json_loads(extra_files.get(METADATA_FILE) or "{}")
    stored = stored if isinstance(stored, dict) else {}
    described = _described(path, program, stored)
    quantized = any("quantized_decomposed" in str(node.target) for node in program.graph.nodes)
    torch.set_num_threads(resolve_threads(options.threads))
    runner = _Runner(path, program, described, quantized)
    note = None if runner.compile_seconds is None else f"compiled for x86 (Inductor, oneDNN int8) in {runner.compile_seconds:.1f} s"
    quantization = metadata_object(path, stored, base.QUANTIZATION_METADATA_KEY)
    dtype = (quantization or {}).get("dtype") or ("int8" if quantized else "fp32")
    return finish_load(path, BACKEND, options, described=described, predict=runner.predict, dtype=dtype, size_bytes=len(data),
                       sha256=hashlib.sha256(data).hexdigest(), stored=stored, declared_classes=None, quantization=quantization, note=note)


def _describe(settings: dict) -> str:
    floats = ", fully-connected layers float" if settings.get("float_linears") else ""
    return describe_settings(settings, types="a:uint8 w:int8") + floats


def _proof(_settings: dict, _int8_path: str) -> str:
    return ("proof (the pair rule on every layer but the depthwise ones, which oneDNN widens before adding: 255 x 128 <= 32,767): "
            "the same on both paths")


BACKEND = Backend(
    NAME, (SUFFIX,), sniff, format="PT2E", suffix_decides=True,
    summary="torchao PT2E (X86InductorQuantizer), a torch.export program (.pt2) run on oneDNN's int8 kernels after Inductor's x86 lowering",
    quantizer=Quantizer(
        quantize, methods=pt2e.METHODS, per_channel=True, leaves_layers_float=False, float_stem=False, options=pt2e.Options,
        overflow_fixes=(overflow.ALL_LAYERS,), describe=_describe,
        tune_refused="tune does not search --backend pt2e yet; use --backend pytorch or onnxruntime",
    ),
    runtime=Runtime(load, settings="torch.set_num_threads(threads); int8: torchao's x86 lowering (oneDNN), chunks of 64 images",
                    spins_when_idle=True),
    # oneDNN has no switch for its exact path: a model under the pair rule on every layer computes the same on both.
    int8_paths=int8_paths.without_exact_switch("a PT2E model", "oneDNN", overflow.ALL_LAYERS, _proof),
)
