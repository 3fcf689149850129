"""Static post-training quantization with onnxruntime.quantization (QDQ format)."""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ptq_cli.atomic import atomic_output
from ptq_cli.errors import PtqError
from ptq_cli.services.calibration import CalibrationSet
from ptq_cli.services.models import ONNXRUNTIME, QUANTIZATION_METADATA_KEY, read_onnx

DTYPES = ("int8", "uint8")
METHODS = ("minmax", "entropy", "percentile")
DEFAULT_PERCENTILE = 99.999
CALIBRATION_BATCH = 100


@dataclass(frozen=True)
class QuantizationSettings:
    """Everything that decides the quantized model; stored inside it and in its evaluation record."""

    dtype: str  # activations: "int8" or "uint8"; names the model's data type
    weight_dtype: str
    per_channel: bool
    method: str
    percentile: float | None  # only for method "percentile"
    preprocess: bool  # onnxruntime's quant_pre_process (shape inference, BN folding) before quantizing
    calibration_samples: int
    calibration_seed: int
    calibration_source: str
    framework: str = ONNXRUNTIME
    format: str = "QDQ"


@dataclass(frozen=True)
class QuantizeResult:
    source: Path
    output: Path
    source_size_bytes: int
    output_size_bytes: int
    settings: QuantizationSettings

    @property
    def size_ratio(self) -> float:
        return self.output_size_bytes / self.source_size_bytes


def default_output(model: Path, dtype: str) -> Path:
    """models/resnet8.onnx -> models/resnet8_int8.onnx."""
    return model.with_name(f"{model.stem}_{dtype}{model.suffix}")


def make_settings(
    dtype: str,
    calibration: CalibrationSet,
    weight_dtype: str | None = None,
    per_channel: bool = False,
    method: str = "minmax",
    percentile: float | None = None,
    preprocess: bool = True,
) -> QuantizationSettings:
    """Validated settings; the weights follow the activations' type unless told otherwise (the seed study)."""
    if dtype not in DTYPES:
        raise PtqError(f"--dtype: '{dtype}' is not one of {', '.join(DTYPES)}")
    weight_dtype = weight_dtype or dtype
    if weight_dtype not in DTYPES:
        raise PtqError(f"--weight-dtype: '{weight_dtype}' is not one of {', '.join(DTYPES)}")
    if method not in METHODS:
        raise PtqError(f"--method: '{method}' is not one of {', '.join(METHODS)}")
    if method == "percentile":
        percentile = DEFAULT_PERCENTILE if percentile is None else percentile
        if not 50.0 < percentile <= 100.0:
            raise PtqError(f"--percentile: {percentile} is not in (50, 100]")
    else:
        percentile = None
    return QuantizationSettings(
        dtype=dtype,
        weight_dtype=weight_dtype,
        per_channel=per_channel,
        method=method,
        percentile=percentile,
        preprocess=preprocess,
        calibration_samples=int(calibration.images.shape[0]),
        calibration_seed=calibration.seed,
        calibration_source=calibration.source,
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


def quantize_onnx(model_path: Path, output: Path, settings: QuantizationSettings, calibration: CalibrationSet) -> QuantizeResult:
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quant_pre_process, quantize_static

    model_path, output = Path(model_path), Path(output)
    model = read_onnx(model_path)
    if model_path.resolve() == output.resolve():
        raise PtqError(f"--output: {output} would overwrite the model being quantized")
    quant_types = {"int8": QuantType.QInt8, "uint8": QuantType.QUInt8}
    methods = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy, "percentile": CalibrationMethod.Percentile}
    extra_options = {"CalibPercentile": settings.percentile} if settings.percentile is not None else {}

    with tempfile.TemporaryDirectory(prefix="ptq-quantize-") as workdir:
        source = model_path
        if settings.preprocess:
            source = Path(workdir) / "preprocessed.onnx"
            quant_pre_process(model, str(source))
        with atomic_output(output) as tmp:
            quantize_static(
                str(source),
                str(tmp),
                _reader(model.graph.input[0].name, calibration.images),
                quant_format=QuantFormat.QDQ,
                per_channel=settings.per_channel,
                activation_type=quant_types[settings.dtype],
                weight_type=quant_types[settings.weight_dtype],
                calibrate_method=methods[settings.method],
                extra_options=extra_options,
            )
            quantized = onnx.load(str(tmp))
            onnx.helper.set_model_props(quantized, {QUANTIZATION_METADATA_KEY: json.dumps(asdict(settings))})
            onnx.save(quantized, str(tmp))
            size = tmp.stat().st_size
    return QuantizeResult(model_path, output, model_path.stat().st_size, size, settings)
