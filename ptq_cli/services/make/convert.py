"""Model conversion, each checked by running source and result on the same real test images."""

from __future__ import annotations

import contextlib
import json
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ptq_cli import inputs
from ptq_cli.backends.base import KERAS_SOURCE_METADATA_KEY, SOURCE_METADATA_KEY
from ptq_cli.datasets import Dataset
from ptq_cli.errors import CheckFailed, PtqError, first_line
from ptq_cli.guards.atomic import atomic_output, check_outputs
from ptq_cli.guards.library_noise import native_stderr_silenced
from ptq_cli.model_file import file_sha256, load_keras, read_onnx
from ptq_cli.services.make import saved_model
from ptq_cli.services.models import load_model
from ptq_cli.transforms.graph import canonical

# Source and converted outputs differ by float32 rounding, which grows with the outputs' size and the network's depth
# (docs: "Conversion check"); a conversion bug moves them by percents. So the limit scales with the outputs.
RELATIVE_TOLERANCE = 1e-3
LIMIT = f"{RELATIVE_TOLERANCE:.1%} of the largest output"  # the limit in words, for help, table and error


@dataclass(frozen=True)
class ConversionCheck:
    images: int
    max_abs_diff: float
    top1_agreement: float  # fraction of images where both models pick the same class
    tolerance: float  # the largest |difference| allowed: RELATIVE_TOLERANCE of the largest |source output|

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.tolerance


@dataclass(frozen=True)
class ConversionResult:
    source: Path
    output: Path
    output_size_bytes: int
    check: ConversionCheck
    # What the converter warned about (e.g. a tf2onnx graph optimizer it could not apply); the check
    # above still decides whether the file is right, these say why it may be larger or slower.
    warnings: tuple[str, ...] = ()

    @property
    def written(self) -> tuple[Path, ...]:
        return (self.output,)


def compare_outputs(reference: np.ndarray, converted: np.ndarray) -> ConversionCheck:
    reference = reference.astype(np.float64)
    scale = max(float(np.max(np.abs(reference))), 1e-3)
    return ConversionCheck(
        images=int(reference.shape[0]),
        max_abs_diff=float(np.max(np.abs(reference - converted))),
        top1_agreement=float(np.mean(reference.argmax(axis=1) == converted.argmax(axis=1))),
        tolerance=RELATIVE_TOLERANCE * scale,
    )


def _checked_write(
    source: Path,
    output: Path,
    write: Callable[[Path], None],
    reference: np.ndarray,
    run_converted: Callable[[Path], np.ndarray],
    warnings: list[str] | None = None,
) -> ConversionResult:
    """Write to a temporary file, compare, and only then put the file in place."""
    with atomic_output(output) as tmp:
        write(tmp)
        check = compare_outputs(reference, run_converted(tmp))
        if not check.passed:
            raise CheckFailed(
                f"{output}: conversion check failed on {check.images} test images: max |diff| "
                f"{check.max_abs_diff:.3g} > {check.tolerance:.3g}, {LIMIT} (top-1 agreement {check.top1_agreement:.2%}); nothing written"
            )
        size = tmp.stat().st_size
    return ConversionResult(source, output, size, check, tuple(warnings or ()))


def check_images(dataset: Dataset, count: int, size: tuple[int, int] | None = None, channels: int | None = None) -> np.ndarray:
    """uint8 pixels of the first `count` images of the evaluation split, at `size` and `channels` if given."""
    if count < 1:
        raise PtqError(f"--check-images: must be at least 1, got {count}")
    split = dataset.evaluation_split()
    return dataset.load(split, size, channels, indices=np.arange(min(count, len(dataset.labels(split))))).images


class _WarningCollector(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            message += f" ({type(error).__name__}: {first_line(error, '')})"
        self.messages.append(message)


@contextlib.contextmanager
def _collected_warnings(logger_name: str) -> Iterator[list[str]]:
    """The logger's warnings as one-line messages, instead of multi-line log output on stderr."""
    logger = logging.getLogger(logger_name)
    collector = _WarningCollector()
    saved = logger.level, logger.propagate
    logger.setLevel(logging.WARNING)
    logger.propagate = False
    logger.addHandler(collector)
    try:
        yield collector.messages
    finally:
        logger.removeHandler(collector)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


@dataclass(frozen=True)
class _KerasModel:
    """A Keras model as conversion uses it (saved_model.SavedModel is the other kind)."""

    model: Any

    @property
    def input_shape(self) -> tuple[int | None, ...]:
        return tuple(self.model.input_shape)

    def predict(self, images: np.ndarray) -> np.ndarray:
        return self.model.predict(images, batch_size=500, verbose=0)

    def to_onnx(self, opset: int) -> Any:
        import tensorflow as tf
        import tf2onnx

        signature = (tf.TensorSpec((None, *self.input_shape[1:]), tf.float32, name="input"),)
        model_proto, _ = tf2onnx.convert.from_keras(self.model, input_signature=signature, opset=opset)
        return model_proto


def keras_to_onnx(keras_path: Path, output: Path, dataset: Dataset, opset: int = 13, check_count: int = 1000,
                  flags: inputs.PreprocessingFlags | None = None) -> ConversionResult:
    """A Keras .keras or .h5 file, or a TensorFlow SavedModel folder (vetted first: saved_model.py) -> ONNX with
    tf2onnx, checked against TensorFlow on `check_count` test images."""
    keras_path = Path(keras_path)
    folder = saved_model.is_saved_model(keras_path)
    if not folder and not keras_path.is_file():
        raise PtqError(f"{keras_path}: Keras model file not found")
    check_outputs([("--output", output, (".onnx",))], [] if folder else [keras_path])
    if check_count < 1:
        raise PtqError(f"--check-images: must be at least 1, got {check_count}")
    try:
        with native_stderr_silenced():
            import tensorflow as tf
            import tf2onnx  # noqa: F401  checked here, used by to_onnx
    except ImportError as error:
        raise PtqError(f"--keras: needs tensorflow-cpu and tf2onnx (pip install -e '.[keras]'): {error}") from error
    source = saved_model.load(keras_path) if folder else _KerasModel(load_keras(tf, keras_path))
    shape = source.input_shape
    if len(shape) != 4 or shape[3] not in (1, 3) or not shape[1] or not shape[2]:
        raise PtqError(f"{keras_path}: model input {shape} is not N x H x W x C images")
    keras_input = inputs.ModelInput("input", inputs.NHWC, shape[3], shape[1], shape[2], None)
    preprocessing = inputs.resolve(flags or inputs.PreprocessingFlags(), None)
    images = inputs.prepare(check_images(dataset, check_count, keras_input.size, keras_input.channels), keras_input, preprocessing)
    reference = source.predict(images)

    converter_warnings: list[str] = []

    def write(tmp: Path) -> None:
        with _collected_warnings("tf2onnx") as messages, native_stderr_silenced():
            model_proto = source.to_onnx(opset)
        converter_warnings.extend(f"tf2onnx: {message}" for message in messages)
        _require_converted(keras_path, model_proto, opset)
        model_proto = canonical(model_proto)
        sha256 = saved_model.digest(keras_path) if folder else file_sha256(keras_path)
        props = {KERAS_SOURCE_METADATA_KEY: json.dumps({"path": str(keras_path.resolve()), "sha256": sha256})}
        if preprocessing != inputs.Preprocessing():
            props[inputs.INPUT_METADATA_KEY] = preprocessing.to_json()
        import onnx

        onnx.helper.set_model_props(model_proto, props)
        tmp.write_bytes(model_proto.SerializeToString())

    return _checked_write(
        keras_path, output, write, reference, lambda tmp: load_model(tmp, None, flags).predict(images), converter_warnings
    )


def _require_converted(keras_path: Path, model_proto, opset: int) -> None:
    """tf2onnx leaves a TensorFlow op it has no ONNX form for as a node of that name (Keras 3's exact GELU's Erfc, an
    XLA-compiled call): a graph no runtime loads. Said in one line, the ops counted."""
    import onnx

    left = Counter(node.op_type for node in model_proto.graph.node if node.domain in ("", "ai.onnx") and not onnx.defs.has(node.op_type))
    if left:
        named = ", ".join(f"{op} ({count})" for op, count in left.most_common())
        raise PtqError(f"{keras_path}: tf2onnx (opset {opset}) has no ONNX form for these TensorFlow ops: {named}; nothing written")


def onnx_to_torchscript(onnx_path: Path, output: Path, dataset: Dataset, check_count: int = 1000,
                        flags: inputs.PreprocessingFlags | None = None) -> ConversionResult:
    """ONNX -> PyTorch with onnx2torch, saved as TorchScript (.pt) or as a torch.export program (.pt2), with the model's
    input contract, checked against onnxruntime. NCHW and NHWC models alike; a fixed batch is made symbolic where that
    computes the same."""
    from ptq_cli.backends import pt2e, pytorch
    from ptq_cli.quantize.pt2e import export, exportable

    check_outputs([("--torch", output, (".pt", ".pt2"))], [onnx_path])
    onnx_path = Path(onnx_path)
    source = load_model(onnx_path, None, flags)
    pixels = check_images(dataset, check_count, source.input.size)
    images = source.prepare(pixels)
    reference = source.predict(images)
    model = read_onnx(onnx_path)
    model.graph.name = str(onnx_path)  # names the file in the backend's messages
    model, described, fixed = pytorch.torch_ready(model, onnx_path, source.input.size)
    module = pytorch.onnx_to_graph_module(model)
    stored = {inputs.INPUT_METADATA_KEY: source.preprocessing.to_json(), SOURCE_METADATA_KEY: source.info.sha256}

    def write(tmp: Path) -> None:
        if Path(output).suffix == pt2e.SUFFIX:
            pt2e.save_program(export(exportable(module), images[: fixed or 2], fixed is not None), tmp, stored, described)
        else:
            pytorch.save_torchscript(module, tmp, images[: fixed or 8], stored, described)

    return _checked_write(onnx_path, output, write, reference, lambda tmp: load_model(tmp).predict(images))
