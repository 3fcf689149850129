"""Learned rounding for a full-integer TFLite model's int8 filters: GPTQ codes on the converter's own grid, from the
float weights, and bias correction, layer by layer against the calibration images (the same closed form as the
onnxruntime models', `rounding.gptq`).

The converter rounds each float weight to its nearest int8 code. Here each CONV_2D and FULLY_CONNECTED filter is
re-rounded, in graph order, from the float model's weights (the calibrated model the converter quantized, matched
by tensor name) to the codes that leave the least output error E||(W - Q) x||^2 over the inputs the int8 model
(its earlier layers already refined) gives the layer, on TFLM's reference kernels (LiteRT's where ptq's copy of TFLM's
kernels does not cover the model: `tflm_kernels.reference_codes`). Each bias then takes up the
mean output error. Scales and zero points stay the converter's, so the file keeps its size and its kernels.
Depthwise filters keep their nearest codes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ptq_cli.quantize.int4 import CurrentInputs, layer_rows, weighted_ops
from ptq_cli.quantize.rounding import gptq
from ptq_cli.transforms.tflite_graph import pack_model, schema_module

QMIN, QMAX = -127, 127  # TFLite's int8 filters: symmetric, zero point 0
REFINED = ("CONV_2D", "FULLY_CONNECTED")


@dataclass(frozen=True)
class RoundingResult:
    data: bytes  # the model with the refined codes and biases
    layers: int  # layers refined
    codes_changed: int  # codes that moved off the converter's
    codes: int  # codes in the refined layers


def _float_tensors(float_data: bytes) -> dict[bytes, np.ndarray]:
    """The float model's constant FLOAT32 tensors, by name."""
    schema = schema_module()
    model_object = schema.ModelT.InitFromObj(schema.Model.GetRootAs(float_data, 0))
    found = {}
    for tensor in model_object.subgraphs[0].tensors:
        data = model_object.buffers[tensor.buffer].data if tensor.buffer else None
        if tensor.type == schema.TensorType.FLOAT32 and data is not None and len(data):
            found[tensor.name] = np.frombuffer(bytes(data), np.float32).reshape([int(dim) for dim in tensor.shape])
    return found


def learned_int8(data: bytes, float_data: bytes, images: np.ndarray, progress: Callable[[int, int], None] | None = None) -> RoundingResult:
    """The int8 model `data` with its filters re-rounded and biases corrected on `images` (its int8 input);
    `float_data` is the float model it was quantized from (the converter's calibrated model)."""
    schema = schema_module()
    model_object = schema.ModelT.InitFromObj(schema.Model.GetRootAs(data, 0))
    graph = model_object.subgraphs[0]
    floats = _float_tensors(float_data)
    layers = weighted_ops(model_object)
    refined = changed = total = 0
    current = CurrentInputs(model_object, images)
    for position, (kind, operator) in enumerate(layers):
        input_tensor, weight_tensor, bias_tensor = (int(index) for index in operator.inputs[:3])
        weight, bias = graph.tensors[weight_tensor], graph.tensors[bias_tensor] if bias_tensor >= 0 else None
        if kind not in REFINED or bias is None or weight.type != schema.TensorType.INT8 or bias.type != schema.TensorType.INT32 \
                or weight.name not in floats or bias.name not in floats:
            continue
        shape = [int(dim) for dim in weight.shape]
        float_weights = floats[weight.name].astype(np.float64).reshape(shape[0], -1)
        scales = np.broadcast_to(np.asarray(weight.quantization.scale, np.float64), (shape[0],))
        nearest = np.frombuffer(bytes(model_object.buffers[weight.buffer].data), np.int8).astype(np.float64).reshape(shape[0], -1)
        rows64 = layer_rows(current, operator, kind, shape)
        codes = gptq(float_weights[None], (rows64.T @ rows64 / len(rows64))[None], scales[None], np.zeros((1, shape[0])), QMIN, QMAX)[0]
        input_scale = float(graph.tensors[input_tensor].quantization.scale[0])
        float_bias = floats[bias.name].astype(np.float64) + (float_weights - codes * scales[:, None]) @ rows64.mean(axis=0)
        bias_codes = np.clip(np.rint(float_bias / (input_scale * scales)), np.iinfo(np.int32).min, np.iinfo(np.int32).max).astype(np.int32)
        model_object.buffers[weight.buffer].data = np.frombuffer(codes.astype(np.int8).tobytes(), np.uint8)
        model_object.buffers[bias.buffer].data = np.frombuffer(bias_codes.tobytes(), np.uint8)
        refined += 1
        changed += int(np.count_nonzero(codes != nearest))
        total += codes.size
        if progress:
            progress(position + 1, len(layers))
    return RoundingResult(pack_model(model_object), refined, changed, total)
