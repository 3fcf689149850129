"""ExecuTorch (`--backend executorch`): torchao's PT2E quantization with ExecuTorch's XNNPACKQuantizer (quantize/pt2e.py),
lowered to the XNNPACK delegate and written as an ExecuTorch program (`.pte`), the file a phone or an ARM board runs;
evaluate and benchmark run it on ExecuTorch's own runtime (its Python bindings, the same C++ runtime and XNNPACK
kernels). The program takes one image a call (XNNPACK's delegate does not resize its inputs here), as a phone calls it;
a model tied to another batch keeps its own. Loading a `.pte` runs no Python: the runtime reads the flatbuffer, checked
for internal consistency first."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from ptq_cli import inputs
from ptq_cli.backends import base
from ptq_cli.backends.base import Backend, LoadedModel, Quantizer, RunOptions, Runtime, describe_settings, finish_load
from ptq_cli.errors import PtqError, first_line
from ptq_cli.guards import bounded
from ptq_cli.guards.atomic import atomic_output
from ptq_cli.model_file import in_fixed_batches, metadata_object, model_input, read_bytes, resolve_threads
from ptq_cli.quantize import overflow, pt2e
from ptq_cli.quantize.carried import carried_for, carried_note
from ptq_cli.quantize.settings import QuantizeCall, QuantizedFile

NAME = "executorch"
SUFFIX = ".pte"
IDENTIFIER = b"ET12"  # the flatbuffer file identifier of an ExecuTorch program, bytes 4-8
METADATA_METHOD = "ptq_metadata"  # a constant method of the program: ptq's metadata, as JSON (the keys of ONNX metadata)
MODEL_INPUT_KEY = "ptq.model_input"
DELEGATION_KEY = "delegation"  # in the settings: each op kind, its nodes on XNNPACK and on ExecuTorch's portable kernels


def available() -> bool:
    try:
        import executorch.runtime  # noqa: F401
    except ImportError:
        return False
    return True


def _require() -> None:
    if not available():
        raise PtqError("ExecuTorch is not installed: pip install 'ptq-cli[executorch]' (make install does)")


def sniff(head: bytes) -> bool:
    return head[4:8] == IDENTIFIER


@contextlib.contextmanager
def _runtime_log(path: Path) -> Iterator[None]:
    """ExecuTorch's runtime logs to the process's stderr (its threadpool's CPU probing at every first run, its errors),
    through the C library or through Python's sys.stderr: kept aside while a program loads and first runs, and its last
    line put in the one-line error where that fails."""
    sys.stderr.flush()
    saved, said = os.dup(2), io.StringIO()
    with tempfile.TemporaryFile() as log:
        os.dup2(log.fileno(), 2)
        try:
            with contextlib.redirect_stderr(said):
                yield
        except Exception as error:
            os.dup2(saved, 2)
            log.seek(0)
            text = log.read(1 << 16).decode(errors="replace") + said.getvalue()[-(1 << 16) :]
            lines = [line.strip() for line in text.splitlines() if line.strip()]
            last = f"; {lines[-1]}" if lines else ""
            raise PtqError(f"{path}: ExecuTorch's runtime failed ({type(error).__name__}: {first_line(error, '')}{last})") from None
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _delegation(edge) -> dict[str, dict[str, int]]:
    """Per op kind of the lowered program, its nodes delegated to XNNPACK and left to the portable kernels."""
    from executorch.devtools.backend_debug import get_delegation_info

    info = get_delegation_info(edge.exported_program().graph_module)
    return {op: {"xnnpack": row.delegated, "portable": row.non_delegated} for op, row in sorted(info.delegation_by_operator.items())
            if op != "getitem"}  # getitem reads the delegate's outputs: not an op that runs


def _lowered(converted, example: np.ndarray, metadata: dict[str, str]) -> tuple[bytes, dict[str, dict[str, int]]]:
    """The quantize/dequantize module exported at the program's batch, lowered to XNNPACK, as .pte bytes, its
    delegation in its metadata's settings. Lowered twice: what is delegated is known after lowering, and the metadata
    (a constant method of the program) is given before it."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    program = pt2e.export(converted, example, fixed_batch=True)
    try:
        delegation = _delegation(to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]))
        settings = {**bounded.json_loads(metadata[base.QUANTIZATION_METADATA_KEY]), DELEGATION_KEY: delegation}
        metadata = {**metadata, base.QUANTIZATION_METADATA_KEY: json.dumps(settings)}
        edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()],
                                           constant_methods={METADATA_METHOD: json.dumps(metadata, sort_keys=True)})
        return edge.to_executorch().buffer, delegation
    except Exception as error:  # exir raises its own errors for ops it cannot lower
        raise PtqError(f"ExecuTorch cannot lower the quantized model ({type(error).__name__}: {first_line(error, '')})") from error


def quantize(call: QuantizeCall) -> QuantizedFile:
    """ONNX -> onnx2torch -> torch.export -> prepare_pt2e (XNNPACKQuantizer) -> calibrate -> convert_pt2e -> XNNPACK
    delegate -> .pte; the program run on ExecuTorch's runtime and judged against the module it was lowered from."""
    model, settings, calibration, stored, progress = call.model, call.settings, call.calibration, call.stored, call.progress
    _require()
    source = pt2e.torch_source(model, calibration, fold=settings.preprocess)
    batch = source.fixed_batch or 1
    module, carried = carried_for(source.module, settings.options, stored.get(base.SOURCE_METADATA_KEY), call.make_weights)
    recipe = pt2e.Recipe(per_channel=bool(settings.per_channel), method=settings.method, pair_safe=False, target=pt2e.XNNPACK, carried=carried)
    converted = pt2e.calibrated(pt2e.export(module, source.example, source.fixed_batch is not None), recipe, source.batches, progress)
    described = replace(source.described, batch=batch)
    extra = bounded.json_loads(stored.pop(base.QUANTIZATION_METADATA_KEY, "{}"))
    contents = {**stored, MODEL_INPUT_KEY: json.dumps(asdict(described)),
                base.QUANTIZATION_METADATA_KEY: json.dumps({**settings.as_dict(), **extra})}
    data, delegation = _lowered(converted, source.example[:batch], contents)
    runner = _Program(Path(call.output), data, batch, resolve_threads(None))
    judged = pt2e.judge_lowering(source.module, converted, lambda images: runner.call(images.numpy()), source.judged, batch)
    if not judged.kept:
        raise PtqError(f"ExecuTorch's XNNPACK lowering changes what the quantized model computes ({judged.describe()}); no model written")
    with atomic_output(call.output) as tmp:
        tmp.write_bytes(data)
    portable = sorted(op for op, counts in delegation.items() if counts["portable"])
    notes = (*carried_note(carried), f"output SQNR against FP32 on {len(source.judged)} calibration images: {judged.lowered_db:.1f} dB (lowered by XNNPACK; "
             f"{judged.program_db:.1f} dB before, {judged.against_program_db:.1f} dB between the two)",
             f"XNNPACK runs {sum(counts['xnnpack'] for counts in delegation.values())} of its nodes; "
             + (f"on ExecuTorch's portable kernels: {', '.join(portable)}" if portable else "none left to the portable kernels"),
             f"one image a call (batch {batch})")
    return QuantizedFile(len(data), (), notes, settings=settings)


class _Program:
    """A .pte's forward method on ExecuTorch's runtime, at its one batch."""

    def __init__(self, path: Path, data: bytes, batch: int | None, threads: int) -> None:
        from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool
        from executorch.runtime import Runtime, Verification

        self.path = path
        with _runtime_log(path):
            _unsafe_reset_threadpool(threads)
            self.program = Runtime.get().load_program(data, verification=Verification.InternalConsistency)
            if "forward" not in self.program.method_names:
                raise ValueError(f"no forward method (it has {', '.join(sorted(self.program.method_names)) or 'none'})")
            self.forward = self.program.load_method("forward")
            meta = self.forward.metadata
            if meta.num_inputs() != 1 or meta.num_outputs() < 1:
                raise ValueError(f"takes {meta.num_inputs()} inputs, not one image batch")
            self.shape = list(meta.input_tensor_meta(0).sizes())
            # The first run, its log kept aside too (the threadpool probes the CPU then): the calls after it run bare,
            # since keeping the log aside costs as much as running a small model.
            self.forward.execute([_tensor(np.zeros(self.shape, np.float32))])
        self.batch = batch if batch is not None else (self.shape[0] if self.shape else 1)

    def stored(self) -> dict[str, str]:
        """ptq's metadata, where ptq made the program."""
        if METADATA_METHOD not in self.program.method_names:
            return {}
        with _runtime_log(self.path):
            value = self.program.load_method(METADATA_METHOD).execute([])
        text = value[0] if isinstance(value, (list, tuple)) and value and isinstance(value[0], str) else "{}"
        stored = bounded.json_loads(text)
        return {str(key): str(item) for key, item in stored.items()} if isinstance(stored, dict) else {}

    def call(self, batch: np.ndarray) -> np.ndarray:
        import torch

        try:
            result = self.forward.execute([_tensor(batch)])
        except Exception as error:  # the runtime's RuntimeError: one line
            raise PtqError(f"{self.path}: ExecuTorch's runtime failed ({type(error).__name__}: {first_line(error, '')})") from None
        if not result or not isinstance(result[0], torch.Tensor):
            raise PtqError(f"{self.path}: returns {type(result[0]).__name__ if result else 'nothing'}, not a tensor of class scores")
        return result[0].float().numpy()

    def predict(self, images: np.ndarray) -> np.ndarray:
        return in_fixed_batches(self.call, images, self.batch)


def _tensor(batch: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(batch, dtype=np.float32))


def _described(path: Path, runner: _Program, stored: dict[str, str]) -> inputs.ModelInput:
    if MODEL_INPUT_KEY in stored:
        with contextlib.suppress(ValueError, TypeError):
            return inputs.ModelInput(**bounded.json_loads(stored[MODEL_INPUT_KEY]))
    return model_input(path, "input", runner.shape)


def load(path: Path, options: RunOptions) -> LoadedModel:
    _require()
    path = Path(path)
    data = read_bytes(path)
    runner = _Program(path, data, None, resolve_threads(options.threads))
    stored = runner.stored()
    described = _described(path, runner, stored)
    runner.batch = described.batch or runner.batch
    quantization = metadata_object(path, stored, base.QUANTIZATION_METADATA_KEY)
    return finish_load(path, BACKEND, options, described=described, predict=runner.predict, dtype=(quantization or {}).get("dtype") or "fp32",
                       size_bytes=len(data), sha256=hashlib.sha256(data).hexdigest(), stored=stored, declared_classes=None,
                       quantization=quantization, note=f"ExecuTorch runtime, XNNPACK delegate, batch {runner.batch} a call")


def _describe(settings: dict) -> str:
    return describe_settings(settings, types="a:int8 w:int8") + ", XNNPACK"


BACKEND = Backend(
    NAME, (SUFFIX,), sniff, format="PTE", available=available,
    summary="torchao PT2E with ExecuTorch's XNNPACKQuantizer, an ExecuTorch program (.pte) on the XNNPACK delegate, as phones run it",
    quantizer=Quantizer(
        # XNNPACK widens its int8 products before adding them: exact on every CPU, so no overflow fix.
        quantize, methods=pt2e.METHODS, per_channel=True, overflow_fixes=(overflow.NO_FIX,), leaves_layers_float=False, float_stem=False, options=pt2e.Options,
        describe=_describe, tune_refused="tune does not search --backend executorch yet; use --backend onnxruntime",
    ),
    runtime=Runtime(load, settings="ExecuTorch runtime (Python bindings), XNNPACK delegate, threadpool of `threads`, batch of the program"),
)
