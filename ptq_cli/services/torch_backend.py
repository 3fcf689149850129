"""PyTorch path: ONNX -> torch.fx with onnx2torch, FX graph-mode int8 quantization, TorchScript files."""

from __future__ import annotations

import io
import json
import tempfile
import warnings
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ptq_cli.atomic import atomic_output
from ptq_cli.services.calibration import CalibrationSet
from ptq_cli.services.graph import static_reshape_targets
from ptq_cli.services.models import TORCHSCRIPT_METADATA_FILE
from ptq_cli.services.quantize import CALIBRATION_BATCH, QuantizationSettings, preprocess_onnx
from ptq_cli.services.torch_compat import import_onnx2torch, quiet_torch_quantization_warnings

ENGINE = "x86"  # fbgemm-based kernels for x86 CPUs


def onnx_to_graph_module(model, fold: bool = True):
    """The ONNX model as a torch.fx GraphModule (onnx2torch).

    With `fold`, onnxruntime's own graph optimizer (quant_pre_process) first folds the batch-norm
    Mul/Add that tf2onnx leaves after each Conv, so the torch graph is plain Conv/ReLU/add/Linear that
    FX quantization fuses and quantizes end to end.
    """
    import onnx

    onnx2torch = import_onnx2torch()
    if fold:
        with tempfile.TemporaryDirectory(prefix="ptq-torch-") as workdir:
            folded = Path(workdir) / "folded.onnx"
            preprocess_onnx(model, folded)
            model = onnx.load(str(folded))
    return onnx2torch.convert(static_reshape_targets(model)).eval()


def save_torchscript(module, path: Path, example: np.ndarray, metadata: dict) -> None:
    """Trace to TorchScript (loads without this project's code) with ptq's metadata inside the file."""
    import torch

    with torch.no_grad(), warnings.catch_warnings():
        # The tracer warns that Reshape's target becomes a constant: static_reshape_targets made it
        # [-1, ...] beforehand, so the trace holds for any batch size (the conversion check runs 1000 images).
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        scripted = torch.jit.trace(module, torch.from_numpy(example), check_trace=False)
    # Saved through a buffer: given a path, torch names the archive's root folder after the file, so
    # the temporary name would make two identical models differ byte for byte.
    buffer = io.BytesIO()
    torch.jit.save(scripted, buffer, _extra_files={TORCHSCRIPT_METADATA_FILE: json.dumps(metadata)})
    Path(path).write_bytes(buffer.getvalue())


def qconfig_mapping(per_channel: bool, method: str):
    """Weights: signed int8, symmetric (the x86 quantized kernels need that). Activations: unsigned 8-bit.

    reduce_range is off: it keeps 7 bits for activations to avoid an overflow in the AVX2 instruction
    older x86 CPUs use; CPUs with VNNI (this one has avx512_vnni) do not need it, and the 8th bit is worth
    about 0.2 points here.
    """
    import torch
    from torch.ao.quantization import QConfig, get_default_qconfig_mapping
    from torch.ao.quantization.observer import HistogramObserver, MinMaxObserver, PerChannelMinMaxObserver

    weight = (
        PerChannelMinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
        if per_channel
        else MinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
    )
    observer = HistogramObserver if method == "histogram" else MinMaxObserver
    activation = observer.with_args(dtype=torch.quint8, reduce_range=False)
    # The x86 mapping keeps its fixed-range settings for ops like softmax; everything else gets ours.
    return get_default_qconfig_mapping(ENGINE).set_global(QConfig(activation=activation, weight=weight))


def quantize_fx(model, output: Path, settings: QuantizationSettings, calibration: CalibrationSet, metadata: dict | None = None) -> int:
    """prepare_fx -> calibrate -> convert_fx, saved as TorchScript; returns the file size.

    `metadata` (e.g. the validation scores `tune` measured) is stored next to the settings in the file."""
    import torch
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    quiet_torch_quantization_warnings()
    torch.backends.quantized.engine = ENGINE
    float_module = onnx_to_graph_module(model, fold=settings.preprocess)
    images = torch.from_numpy(calibration.images)
    prepared = prepare_fx(float_module, qconfig_mapping(settings.per_channel, settings.method), (images[:1],))
    with torch.no_grad():
        for batch in torch.split(images, CALIBRATION_BATCH):
            prepared(batch)
    quantized = convert_fx(prepared)
    with atomic_output(output) as tmp:
        save_torchscript(quantized, tmp, calibration.images[:8], {**asdict(settings), **(metadata or {})})
        return tmp.stat().st_size
