"""Static post-training quantization with onnxruntime.quantization (QDQ format)."""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from ptq_cli.atomic import atomic_output, check_writable
from ptq_cli.errors import PtqError
from ptq_cli.services.calibration import CalibrationSet
from ptq_cli.services.models import NCHW, ONNXRUNTIME, PRUNING_METADATA_KEY, PYTORCH, QUANTIZATION_METADATA_KEY, onnx_layout, read_onnx, to_layout
from ptq_cli.services.space_to_depth import Rewrite, quantized_pads, space_to_depth_convs

DTYPES = ("int8", "uint8")
BACKENDS = (ONNXRUNTIME, PYTORCH)
# Each library's own calibration methods; the first is the default.
METHODS = {ONNXRUNTIME: ("minmax", "entropy", "percentile"), PYTORCH: ("histogram", "minmax")}
# ONNX Runtime keeps the seed study's per-tensor default; PyTorch's x86 default is per-channel.
DEFAULT_PER_CHANNEL = {ONNXRUNTIME: False, PYTORCH: True}
FORMATS = {ONNXRUNTIME: "QDQ", PYTORCH: "FX"}
DEFAULT_PERCENTILE = 99.999
DEFAULT_DTYPE = "int8"
# `--target speed`: the fast configuration on x86. onnxruntime's x86 int8 kernels (VNNI) multiply
# unsigned activations by signed weights; int8 x int8 and uint8 x uint8 fall back to slower paths.
# Per-channel weights with percentile calibration keep the accuracy (see README for the figures).
TARGETS = ("speed",)
PRESETS = {
    "speed": {
        ONNXRUNTIME: {"dtype": "uint8", "weight_dtype": "int8", "per_channel": True, "method": "percentile"},
        PYTORCH: {},  # PyTorch's x86 int8 is already uint8 activations x int8 per-channel weights
    }
}
CALIBRATION_BATCH = 100


@dataclass(frozen=True)
class QuantizationSettings:
    """Everything that decides the quantized model; stored inside it and in its evaluation record."""

    framework: str  # ONNXRUNTIME or PYTORCH
    format: str  # "QDQ" (onnxruntime) or "FX" (torch.ao FX graph mode)
    dtype: str  # activations: "int8" or "uint8"; names the model's data type
    weight_dtype: str
    per_channel: bool
    method: str
    percentile: float | None  # only for method "percentile"
    preprocess: bool  # onnxruntime's quant_pre_process (shape inference, BN folding) before quantizing
    # Filled in by quantize() from the calibration set it was given.
    calibration_samples: int = 0
    calibration_seed: int | None = None
    calibration_source: str | None = None
    target: str | None = None  # the preset the settings came from, if any
    float_nodes: tuple[str, ...] = ()  # nodes left in float (names in the preprocessed graph)
    # Regroup the convolutions onnxruntime's fast x86 int8 kernel handles poorly (the RGB stem, 16-channel
    # layers) over blocks of pixels (services/space_to_depth.py); same products.
    space_to_depth: bool = False


@dataclass(frozen=True)
class QuantizeResult:
    source: Path
    output: Path
    source_size_bytes: int
    output_size_bytes: int
    settings: QuantizationSettings
    space_to_depth: tuple[Rewrite, ...] = ()  # the convolutions regrouped before quantizing

    @property
    def size_ratio(self) -> float:
        return self.output_size_bytes / self.source_size_bytes


def default_output(model: Path, settings: QuantizationSettings) -> Path:
    """models/resnet8.onnx -> models/resnet8_int8.onnx, resnet8_uint8_speed.onnx, or resnet8_pytorch_int8.pt."""
    suffix = f"_{settings.target}" if settings.target and settings.framework == ONNXRUNTIME else ""
    if settings.framework == PYTORCH:
        return model.with_name(f"{model.stem}_pytorch_{settings.dtype}.pt")
    return model.with_name(f"{model.stem}_{settings.dtype}{suffix}{model.suffix}")


def make_settings(
    dtype: str | None = None,
    backend: str = ONNXRUNTIME,
    weight_dtype: str | None = None,
    per_channel: bool | None = None,
    method: str | None = None,
    percentile: float | None = None,
    preprocess: bool = True,
    target: str | None = None,
    space_to_depth: bool | None = None,
) -> QuantizationSettings:
    """Validated settings. Without a target the defaults are the seed study's, the weights following the
    activations' type; a target's preset fills in what the options leave open. Space-to-depth is on by
    default where it speeds the model up: onnxruntime, uint8 activations x int8 weights."""
    if backend not in BACKENDS:
        raise PtqError(f"--backend: '{backend}' is not one of {', '.join(BACKENDS)}")
    if target is not None and target not in TARGETS:
        raise PtqError(f"--target: '{target}' is not one of {', '.join(TARGETS)}")
    preset = PRESETS[target][backend] if target else {}
    dtype = dtype or preset.get("dtype") or DEFAULT_DTYPE
    weight_dtype = weight_dtype or preset.get("weight_dtype")
    per_channel = preset.get("per_channel") if per_channel is None else per_channel
    method = method or preset.get("method")
    if dtype not in DTYPES:
        raise PtqError(f"--dtype: '{dtype}' is not one of {', '.join(DTYPES)}")
    weight_dtype = weight_dtype or dtype
    if weight_dtype not in DTYPES:
        raise PtqError(f"--weight-dtype: '{weight_dtype}' is not one of {', '.join(DTYPES)}")
    if backend == PYTORCH and "uint8" in (dtype, weight_dtype):
        option = "--dtype" if dtype == "uint8" else "--weight-dtype"
        raise PtqError(
            f"{option} uint8: PyTorch's x86/fbgemm quantized convolutions need signed int8 weights "
            "(their activations are uint8 already); use --dtype int8, or --backend onnxruntime for uint8"
        )
    method = method or METHODS[backend][0]
    if space_to_depth and backend != ONNXRUNTIME:
        raise PtqError("--space-to-depth: applies to --backend onnxruntime only")
    if space_to_depth is None:
        space_to_depth = preset.get("space_to_depth", backend == ONNXRUNTIME and (dtype, weight_dtype) == ("uint8", "int8"))
    if method not in METHODS[backend]:
        raise PtqError(f"--method: '{method}' is not a {backend} calibration method ({', '.join(METHODS[backend])})")
    if method == "percentile":
        percentile = DEFAULT_PERCENTILE if percentile is None else percentile
        if not 50.0 < percentile <= 100.0:
            raise PtqError(f"--percentile: {percentile} is not in (50, 100]")
    elif percentile is not None:
        raise PtqError("--percentile: only applies to --method percentile")
    return QuantizationSettings(
        framework=backend,
        format=FORMATS[backend],
        dtype=dtype,
        weight_dtype=weight_dtype,
        per_channel=DEFAULT_PER_CHANNEL[backend] if per_channel is None else per_channel,
        method=method,
        percentile=percentile,
        preprocess=preprocess,
        target=target,
        space_to_depth=space_to_depth,
    )


def _reader(input_name: str, images: np.ndarray):
    from onnxruntime.quantization import CalibrationDataReader

    class BatchReader(CalibrationDataReader):
        def __init__(self) -> None:
            self._batches = iter(np.array_split(images, max(1, len(images) // CALIBRATION_BATCH)))

        def get_next(self) -> dict[str, np.ndarray] | None:
            batch = next(self._batches, None)
            return None if batch is None else {input_name: batch}

    return BatchReader()


def preprocess_onnx(model, output: Path) -> None:
    """onnxruntime's recommended pre-quantization step: shape inference plus its basic graph optimizer,
    which folds the batch-norm Mul/Add after each Conv into the Conv."""
    from onnxruntime.quantization import quant_pre_process

    quant_pre_process(model, str(output))


def quantize(model_path: Path, output: Path, settings: QuantizationSettings, calibration: CalibrationSet) -> QuantizeResult:
    """Quantize the FP32 ONNX model with the settings' framework; the output is written atomically."""
    model_path, output = Path(model_path), Path(output)
    model = read_onnx(model_path)
    if model_path.resolve() == output.resolve():
        raise PtqError(f"--output: {output} would overwrite the model being quantized")
    check_writable(output)
    if onnx_layout(model_path, model) == NCHW and settings.framework == PYTORCH:
        raise PtqError(f"{model_path}: NCHW input; the PyTorch backend takes NHWC models (quantize it with --backend onnxruntime)")
    settings = replace(
        settings,
        calibration_samples=int(calibration.images.shape[0]),
        calibration_seed=calibration.seed,
        calibration_source=calibration.source,
    )
    if settings.framework == PYTORCH:
        from ptq_cli.services.torch_backend import quantize_fx

        return QuantizeResult(model_path, output, model_path.stat().st_size, quantize_fx(model, output, settings, calibration), settings)
    written = quantize_onnx(model, output, settings, calibration)
    return QuantizeResult(model_path, output, model_path.stat().st_size, written.size_bytes, settings, written.space_to_depth)


@dataclass(frozen=True)
class OnnxQuantized:
    size_bytes: int
    space_to_depth: tuple[Rewrite, ...]


def quantize_onnx(
    model, output: Path, settings: QuantizationSettings, calibration: CalibrationSet, metadata: dict | None = None
) -> OnnxQuantized:
    """onnxruntime.quantization.quantize_static in QDQ format: the file's size, and what space-to-depth regrouped.

    `metadata` (e.g. the validation scores `tune` measured) is stored next to the settings in the model."""
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    quant_types = {"int8": QuantType.QInt8, "uint8": QuantType.QUInt8}
    methods = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy, "percentile": CalibrationMethod.Percentile}
    extra_options = {"CalibPercentile": settings.percentile} if settings.percentile is not None else {}

    with tempfile.TemporaryDirectory(prefix="ptq-quantize-") as workdir:
        source = model  # quantize_static takes the ModelProto, or the preprocessed file's path
        if settings.preprocess:
            source = str(Path(workdir) / "preprocessed.onnx")
            preprocess_onnx(model, source)
        rewrites: list[Rewrite] = []
        if settings.space_to_depth:
            graph = onnx.load(source) if isinstance(source, str) else onnx.ModelProto.FromString(model.SerializeToString())
            graph, rewrites = space_to_depth_convs(graph, skip=set(settings.float_nodes))  # a float conv gains nothing
            if rewrites:
                source = str(Path(workdir) / "space_to_depth.onnx")
                onnx.save(graph, source)
        # quantize_static print()s its histogram progress; stdout belongs to ptq's own output (--json).
        with atomic_output(output) as tmp, contextlib.redirect_stdout(io.StringIO()):
            quantize_static(
                source,
                str(tmp),
                # Calibration images are NHWC; an NCHW model gets them transposed, as at inference.
                _reader(model.graph.input[0].name, to_layout(calibration.images, onnx_layout(Path(model.graph.name), model))),
                quant_format=QuantFormat.QDQ,
                per_channel=settings.per_channel,
                activation_type=quant_types[settings.dtype],
                weight_type=quant_types[settings.weight_dtype],
                calibrate_method=methods[settings.method],
                nodes_to_exclude=list(settings.float_nodes),
                extra_options=extra_options,
            )
            quantized = onnx.load(str(tmp))
            if rewrites:
                quantized_pads(quantized)
            described = {**asdict(settings), "space_to_depth_convs": [asdict(rewrite) for rewrite in rewrites], **(metadata or {})}
            props = {QUANTIZATION_METADATA_KEY: json.dumps(described)}
            props.update({prop.key: prop.value for prop in model.metadata_props if prop.key == PRUNING_METADATA_KEY})  # a pruned source stays described
            onnx.helper.set_model_props(quantized, props)
            onnx.save(quantized, str(tmp))
            return OnnxQuantized(tmp.stat().st_size, tuple(rewrites))
