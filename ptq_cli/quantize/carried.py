"""An onnxruntime QDQ model's 8-bit weights carried into a torch module for the PT2E flow (`--weights-from`): what ptq's
engine chose for them there (learned rounding: each weight's code; the pair rule: each channel's scale) becomes the
module's weights, and the PT2E weight observer hands back the QDQ model's scales, so both models compute with the same
codes. Each matched layer also adds the bias the QDQ model adds (learned rounding corrects it for the layer's
codes). The layers the QDQ model keeps in float (a float stem) stay float.

Layers are matched by their weights' values, not their names: onnx2torch, onnxruntime's pre-processing and ptq's
placement name nodes differently, while a layer's 8-bit weights lie within a few per cent of its float ones.
"""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ptq_cli import model_file
from ptq_cli.errors import PtqError, first_line
from ptq_cli.quantize import overflow
from ptq_cli.quantize.settings import WeightsMaker

MATCH_TOLERANCE = 0.05  # relative distance between a layer's float weights and its 8-bit ones, at most
MADE_HERE = "onnxruntime"  # --weights-from's default: ptq's onnxruntime model, made first from the same images
NONE = "none"  # --weights-from none: the PT2E flow's own rounding

@dataclass(frozen=True)
class CarriedWeights:
    """What a QDQ model gives a torch module: each matched layer's weights (dequantized, torch layout) and the bias it
    adds, the scales of each by the digest of those weights (what the weight observer sees), and the layers it keeps
    in float."""

    source: Path
    weights: dict[str, np.ndarray] = field(default_factory=dict)  # module name -> weights
    biases: dict[str, np.ndarray] = field(default_factory=dict)  # module name -> the bias the QDQ model adds (bias correction in it)
    scales: dict[str, np.ndarray] = field(default_factory=dict)  # digest of the weights -> per output channel (or one)
    float_layers: tuple[str, ...] = ()  # layers whose float weights the QDQ model computes with
    own_layers: tuple[str, ...] = ()  # layers matched to neither (rewritten there): quantized here, as without --weights-from
    per_channel: bool = True
    failed: str = ""  # why ptq's onnxruntime model could not give its weights (MADE_HERE): the flow's own rounding then

    def scales_of(self, weight: np.ndarray) -> np.ndarray | None:
        return self.scales.get(digest(weight))


def digest(weight: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(weight, dtype=np.float32).tobytes()).hexdigest()


def stored_settings(path: Path) -> dict:
    """The settings ptq stored in a QDQ model ({} for a model ptq did not make)."""
    qdq = model_file.read_onnx(Path(path))
    stored = {prop.key: prop.value for prop in qdq.metadata_props}
    return model_file.metadata_object(Path(path), stored, model_file.QUANTIZATION_METADATA_KEY) or {}


def _float_weights(qdq) -> list[np.ndarray]:
    """The float weights the QDQ model's layers compute with (no DequantizeLinear before them)."""
    from onnx import numpy_helper

    constants = {initializer.name: initializer for initializer in qdq.graph.initializer}
    return [numpy_helper.to_array(constants[node.input[1]]) for node in qdq.graph.node
            if node.op_type in ("Conv", "Gemm", "MatMul") and len(node.input) > 1 and node.input[1] in constants
            and constants[node.input[1]].data_type == 1]  # FLOAT


def _closest(weight: np.ndarray, candidates: list[tuple[np.ndarray, Any]]) -> tuple[float, np.ndarray | None, Any]:
    """(relative distance, values in the weight's layout, what came with them) of the candidate closest to `weight`:
    the same shape, or a 2-D one transposed (a Gemm's)."""
    options = [(option, extra) for values, extra in candidates for option in (values, values.T if values.ndim == 2 else None)
               if option is not None and option.shape == weight.shape]
    scored = [(float(np.linalg.norm(option - weight) / (np.linalg.norm(weight) + 1e-12)), option, extra) for option, extra in options]
    return min(scored, key=lambda row: row[0], default=(np.inf, None, None))


def _quantized_weights(qdq) -> list[tuple[np.ndarray, tuple[np.ndarray, np.ndarray | None]]]:
    """Each symmetric 8-bit weight of the QDQ model as (dequantized values, (scales along its quantized axis or one, the
    bias its layer adds, as that model computes it: learned rounding's bias correction is in it))."""
    from onnx import numpy_helper

    constants = {initializer.name: numpy_helper.to_array(initializer) for initializer in qdq.graph.initializer}
    producers = {output: node for node in qdq.graph.node for output in node.output}
    layers = {node.input[1]: node for node in qdq.graph.node if node.op_type in ("Conv", "Gemm") and len(node.input) > 1}
    found = []
    for node in qdq.graph.node:
        codes = constants.get(node.input[0]) if node.op_type == "DequantizeLinear" else None
        if codes is None or codes.dtype not in (np.int8, np.uint8) or codes.ndim < 2 or node.input[1] not in constants:
            continue
        scale = constants[node.input[1]].astype(np.float32)
        zero = constants[node.input[2]].astype(np.float32) if len(node.input) > 2 and node.input[2] in constants else np.zeros_like(scale)
        if np.any(zero != 0):  # asymmetric (uint8) weights: no symmetric int8 code gives them, so the layer is quantized here
            continue
        axis = next((attribute.i for attribute in node.attribute if attribute.name == "axis"), 1) % codes.ndim
        shape = [1] * codes.ndim
        if scale.size > 1:
            shape[axis] = scale.size
        values = codes.astype(np.float32) * scale.reshape(shape)
        # per output channel: axis 0 of a Conv's, 1 of a Gemm's (transposed for torch)
        found.append((values, (scale.reshape(-1), _bias(layers.get(node.output[0]), constants, producers))))
    return found


def _bias(layer, constants: dict[str, np.ndarray], producers: dict) -> np.ndarray | None:
    """The bias a QDQ model's layer adds: a float constant, or int32 codes dequantized (None: none, or another form)."""
    if layer is None or len(layer.input) < 3 or not layer.input[2]:
        return None
    name = layer.input[2]
    if name in constants:
        return constants[name].astype(np.float32).reshape(-1)
    dequantize = producers.get(name)
    if dequantize is None or dequantize.op_type != "DequantizeLinear" or dequantize.input[0] not in constants or dequantize.input[1] not in constants:
        return None
    return (constants[dequantize.input[0]].astype(np.float64) * constants[dequantize.input[1]].astype(np.float64)).astype(np.float32).reshape(-1)


def carried_weights(module: Any, qdq, source: Path) -> CarriedWeights:
    """Each convolution and fully-connected layer of the torch module matched to the QDQ model's 8-bit weights closest
    to its own (the same shape, or transposed for a Gemm's), within MATCH_TOLERANCE; else to the float weights it
    computes with (a layer it keeps float); else to neither (a layer it rewrote, quantized here)."""
    import torch

    candidates = _quantized_weights(qdq)
    floats_there = [(values, None) for values in _float_weights(qdq)]
    weights: dict[str, np.ndarray] = {}
    biases: dict[str, np.ndarray] = {}
    scales_by_digest: dict[str, np.ndarray] = {}
    floats: list[str] = []
    own: list[str] = []
    for name, layer in module.named_modules():
        if not isinstance(layer, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Linear)):
            continue
        weight = layer.weight.detach().numpy()
        distance, values, extra = _closest(weight, candidates)
        if values is not None and extra is not None and distance <= MATCH_TOLERANCE:
            weights[name] = np.ascontiguousarray(values, dtype=np.float32)
            scales_by_digest[digest(weights[name])], bias = extra
            if bias is not None and layer.bias is not None and bias.shape == tuple(layer.bias.shape):
                biases[name] = bias
        elif _closest(weight, floats_there)[0] <= 1e-5:
            floats.append(name)
        else:
            own.append(name)
    if not weights:
        raise PtqError(f"--weights-from: {source}: none of its 8-bit weights fits a layer of this model")
    return CarriedWeights(Path(source), weights, biases, scales_by_digest, tuple(floats), tuple(own),
                          any(scales.size > 1 for _, (scales, _bias) in candidates))


def carry_into(module: Any, carried: CarriedWeights) -> None:
    """The module's matched layers given the QDQ model's weights, in place."""
    import torch

    with torch.no_grad():
        for name, values in carried.weights.items():
            module.get_submodule(name).weight.copy_(torch.from_numpy(values))
        for name, bias in carried.biases.items():
            module.get_submodule(name).bias.copy_(torch.from_numpy(bias))


def carried_observer_class(base: Any, carried: CarriedWeights, pair_safe: bool) -> Any:
    """`base` (a weight observer class) handing back the QDQ model's scales for the weights carried from it, where
    they keep the codes the QDQ model has (and, with `pair_safe`, follow the pair rule); `base`'s own elsewhere."""
    import torch

    class CarriedObserver(base):  # type: ignore[misc, valid-type]
        def forward(self, weight):
            self.carried_seen = weight.detach()
            return super().forward(weight)

        def calculate_qparams(self):
            weight = self.carried_seen.float().numpy()
            scales = carried.scales_of(weight)
            if scales is not None:
                rows, _ = overflow.weight_rows("Conv", weight)
                codes = overflow.quantize_rows(rows, np.broadcast_to(scales, (len(rows),)).astype(np.float32))
                if not pair_safe or overflow.is_pair_safe(codes):
                    return torch.from_numpy(np.ascontiguousarray(scales)), torch.zeros(scales.size, dtype=torch.int64)
            return super().calculate_qparams()

    return CarriedObserver


def carried_for(module: Any, options: Any, source_sha256: str | None, maker: WeightsMaker | None,
                pair_safe: bool = False) -> tuple[Any, CarriedWeights | None]:
    """(the module to quantize, the weights carried): with `--weights-from` (the backend's options), a copy of the
    module given that QDQ model's weights (the float module stays what fidelity is measured against); else the module.
    MADE_HERE has `maker` (QuantizeCall.make_weights) make ptq's onnxruntime model first (under the pair rule on every
    layer with `pair_safe`); where no service gave a maker, the flow keeps its own rounding."""
    import copy

    path = getattr(options, "weights_from", None)
    if path is None or str(path) == NONE:
        return module, None
    if str(path) == MADE_HERE:
        if maker is None:
            return module, None
        named = Path("ptq's onnxruntime model")
        with tempfile.TemporaryDirectory(prefix="ptq-weights-") as workdir:
            made = Path(workdir) / "onnxruntime_int8.onnx"
            try:  # a model onnxruntime's flow cannot take is still quantized by PT2E's own
                maker(made, pair_safe)
                carried = carried_weights(module, model_file.read_onnx(made), named)
            except PtqError as error:
                return module, CarriedWeights(named, failed=first_line(error))
    else:
        carried = carried_weights(module, model_file.read_made_from(Path(path), source_sha256, "--weights-from"), Path(path))
    quantized = copy.deepcopy(module)
    carry_into(quantized, carried)
    return quantized, carried


def carried_note(carried: CarriedWeights | None) -> tuple[str, ...]:
    if carried is None:
        return ()
    if carried.failed:
        return (f"weights: PT2E's own rounding ({carried.source} could not be made: {carried.failed})",)
    floats = f"; kept float as there: {', '.join(carried.float_layers)}" if carried.float_layers else ""
    own = f"; quantized here (rewritten there): {', '.join(carried.own_layers)}" if carried.own_layers else ""
    biases = f", the biases of {len(carried.biases)}" if carried.biases else ""
    return (f"weights of {len(carried.weights)} layers from {carried.source.name} (its codes and scales{biases}){floats}{own}",)
