"""Whether the stem (the layers the image enters first) stays in float: measured for each model and settings.

Some networks' stems cost them most of their 8-bit fidelity: their int8 weights alone cost the output about
as much as all the model's weights together (docs: ImageNet-size classifiers). Kept in float, the stem is a
few percent of the compute and the image itself is not quantized. ptq quantizes the FP32 model's stem weights alone, as
the settings would (granularity, the pair rule of an overflow fix), runs both models on a few calibration
images and keeps the stem in float where the output's SQNR falls below STEM_FLOAT_BELOW_DB.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

from ptq_cli import backends
from ptq_cli.quantize import overflow
from ptq_cli.quantize.settings import QuantizationSettings
from ptq_cli.services.quant_settings import FLOAT, INT8

# An int8 stem that alone leaves less than this SQNR at the output costs about as much as a whole int8
# model's error (docs): it stays in float.
STEM_FLOAT_BELOW_DB = 25.0
PROBE_IMAGES = 64  # the first calibration images, enough for a stable SQNR


def int8_weights(weight: np.ndarray, op_type: str, trans_b: bool, per_channel: bool, pair_rule: bool, unsigned: bool) -> np.ndarray:
    """The weight after an 8-bit round trip as onnxruntime quantizes it (its own `quantize_data`, per output
    channel or per tensor): symmetric int8, with ptq's pair-safe scales under an overflow fix, or uint8 (asymmetric
    per tensor, around 128 per channel)."""
    import onnx
    from onnxruntime.quantization.quant_utils import quantize_data

    rows, _ = overflow.weight_rows(op_type, weight, trans_b)
    rows = rows.astype(np.float32)
    if pair_rule and not unsigned:
        scales = overflow.pair_safe_scales(rows)
        scales = np.full_like(scales, scales.max()) if not per_channel else scales
        back = overflow.quantize_rows(rows, scales) * scales[:, None]
    else:
        kind = onnx.TensorProto.UINT8 if unsigned else onnx.TensorProto.INT8
        symmetric = per_channel or not unsigned  # onnxruntime's per-channel uint8 weights sit around code 128 too

        def round_trip(values: np.ndarray) -> np.ndarray:
            zero, scale, codes = quantize_data(values.reshape(-1), kind, symmetric)
            return ((codes.astype(np.float64) - zero) * scale).reshape(values.shape)

        back = np.stack([round_trip(row) for row in rows]) if per_channel else round_trip(rows)
    back = back.astype(weight.dtype)
    rows_first = op_type == "Conv" or (op_type == "Gemm" and trans_b)  # weight_rows' two layouts
    return back.reshape(weight.shape) if rows_first else back.T.reshape(weight.shape)


def stem_cost_db(model, images: np.ndarray, settings: QuantizationSettings) -> float | None:
    """The output's SQNR (dB) against FP32 with only the stem's weights in 8 bits, on `images` (the model's
    input format); None for a model without a weighted stem, or whose outputs do not move."""
    import onnx
    from onnx import numpy_helper

    from ptq_cli.metrics import sqnr_db
    from ptq_cli.services.models import load_model
    from ptq_cli.transforms.graph import preprocessed

    with tempfile.TemporaryDirectory(prefix="ptq-stem-") as workdir:
        reference_path, stem_path = Path(workdir) / "preprocessed.onnx", Path(workdir) / "stem.onnx"
        if settings.preprocess:  # the graph the quantizer sees: batch norm folded into the stem
            graph = preprocessed(model, Path(workdir))
        else:
            graph = onnx.ModelProto.FromString(model.SerializeToString())
            onnx.save(graph, str(reference_path))
        initializers = {init.name: init for init in graph.graph.initializer}
        pair_rule = overflow.bounds_stem(settings.overflow_fix)
        changed = 0
        for node in overflow.first_layers(graph):
            init = initializers.get(node.input[1]) if len(node.input) > 1 else None
            if init is None:
                continue
            weight = numpy_helper.to_array(init)
            if weight.ndim < 2 or not np.issubdtype(weight.dtype, np.floating):
                continue
            exempt = node.op_type == "Conv" and overflow.is_depthwise(node, weight.shape)
            trans_b = any(attribute.name == "transB" and attribute.i for attribute in node.attribute)
            quantized = int8_weights(weight, node.op_type, trans_b, bool(settings.per_channel), pair_rule and not exempt, settings.weight_dtype == "uint8")
            init.CopyFrom(numpy_helper.from_array(quantized, init.name))
            changed += 1
        if not changed:
            return None
        onnx.save(graph, str(stem_path))
        probe = images[:PROBE_IMAGES]
        reference = load_model(reference_path, None).predict(probe)
        measured = load_model(stem_path, None).predict(probe)
    return sqnr_db(reference, measured) if reference.any() else None


def resolve_stem(settings: QuantizationSettings, model, images: np.ndarray, costs: dict | None = None) -> QuantizationSettings:
    """The settings with the stem decided: kept if named, int8 where the backend cannot leave it float,
    else measured (`costs` caches the measurement per granularity, weight type and fix)."""
    if settings.stem is not None:
        return settings
    if not backends.backend(settings.backend).quantizes.float_stem:
        return replace(settings, stem=INT8)
    costs = {} if costs is None else costs
    key = (bool(settings.per_channel), settings.weight_dtype, overflow.bounds_stem(settings.overflow_fix), settings.preprocess)
    if key not in costs:
        costs[key] = stem_cost_db(model, images, settings)
    cost = costs[key]
    if cost is None:
        return replace(settings, stem=INT8)
    return replace(settings, stem=FLOAT if cost < STEM_FLOAT_BELOW_DB else INT8).with_evidence(stem_sqnr_db=round(cost, 2) if np.isfinite(cost) else None)


def describe_stem(stem: str | None, sqnr_db: float | None) -> str:
    """e.g. "float (its weights alone in 8 bits: 17.4 dB SQNR at the output, below 25 dB)"."""
    if stem is None:
        return "auto"
    if sqnr_db is None:
        return stem
    verdict = "below" if sqnr_db < STEM_FLOAT_BELOW_DB else "at least"
    return f"{stem} (its weights alone in 8 bits: {sqnr_db:.1f} dB SQNR at the output, {verdict} {STEM_FLOAT_BELOW_DB:g} dB)"
