"""The engine over torchao's PT2E quantization (`--backend pt2e`, `--backend executorch`): a torch module exported with
torch.export, annotated by the quantizer of the target (torchao's X86InductorQuantizer; ExecuTorch's XNNPACKQuantizer),
calibrated on ptq's calibration images, converted to a quantize/dequantize program, then lowered by the backend
(torch.compile for x86: Inductor's freezing passes, oneDNN's int8 kernels, the rest fused; ExecuTorch's XNNPACK
delegate) and judged after lowering: a lowering that changes what the program computes is refused, not shipped.

What the flow carries of ptq's choices: per-channel or per-tensor weights, the activation observer (histogram or
minmax), the pair rule on every layer's weights for a model right on every x86 CPU (`--cpus all`: no pair of u8 x s8
products overflows the int16 sums of CPUs without VNNI, whatever the kernel's order; 7-bit activations would not do,
since the lowered kernels requantize to the whole 0-255), and fully-connected layers kept in float where lowering
them loses fidelity. What it does not (yet): searched ranges, per-image ranges and learned rounding, which ptq writes
into ONNX QDQ models.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ptq_cli import inputs
from ptq_cli.errors import PtqError, first_line
from ptq_cli.guards.library_noise import torchao_pt2e_imported
from ptq_cli.metrics import sqnr_db
from ptq_cli.quantize import overflow
from ptq_cli.quantize.carried import MADE_HERE, NONE, CarriedWeights, carried_observer_class, stored_settings
from ptq_cli.quantize.settings import HELD_OUT_EVERY, HELD_OUT_MAX, BackendOptions, CommonChoices, option
from ptq_cli.quantize.torch_graph import onnx_to_graph_module, torch_ready

METHODS = ("histogram", "minmax")
MOST_BATCH = 65_536  # the batch dimension of an exported program: open up to this
CALIBRATION_BATCH = 100  # images a calibration call, where the model's batch is open
X86, XNNPACK = "x86", "xnnpack"  # the quantizer's target: oneDNN through Inductor, or ExecuTorch's XNNPACK delegate
# A lowering is kept where it computes what the quantize/dequantize program computes (output SQNR between the two, on
# held-out calibration images, at least LOWERING_SQNR_DB: rounding differences between the reference ops and the
# integer kernels stay above it on small networks), or where it is at most LOWERING_LOSS_DB further from FP32 than the
# program (a deep network's integer kernels round each layer otherwise, and their differences grow with depth without
# costing fidelity). A wrong kernel fails both: ResNet8's classifier, 86.7% top-1 before lowering, 16% after.
LOWERING_SQNR_DB = 25.0
LOWERING_LOSS_DB = 1.0


@dataclass(frozen=True)
class LoweringJudgement:
    """A lowered model's output SQNR against the program it was lowered from, and both models' against FP32."""

    against_program_db: float
    program_db: float  # the quantize/dequantize program against FP32
    lowered_db: float  # the lowered model against FP32

    @classmethod
    def of(cls, float_scores: np.ndarray, program_scores: np.ndarray, lowered_scores: np.ndarray) -> LoweringJudgement:
        return cls(sqnr_db(program_scores, lowered_scores), sqnr_db(float_scores, program_scores), sqnr_db(float_scores, lowered_scores))

    @property
    def kept(self) -> bool:
        return self.against_program_db >= LOWERING_SQNR_DB or self.lowered_db >= self.program_db - LOWERING_LOSS_DB

    def describe(self) -> str:
        return (f"SQNR {self.against_program_db:.1f} dB against the program before it; against FP32 {self.lowered_db:.1f} dB lowered, "
                f"{self.program_db:.1f} dB before")


def _imports() -> None:
    """torchao's PT2E modules, which also register the quantized_decomposed operators a program calls."""
    torchao_pt2e_imported()


def _static_call(layer: Any, constants: list) -> tuple[Any, tuple, dict] | None:
    """(function, its arguments after the input, its keywords) computing what one of onnx2torch's run-time-shaped
    layers computes, given its other inputs' constant values; None for a layer of another kind."""
    import torch
    from onnx2torch.node_converters import pad, reshape, squeeze, unsqueeze

    values = [None if value is None else [int(v) if float(v).is_integer() else float(v) for v in value.reshape(-1).tolist()] for value in constants]
    if isinstance(layer, reshape.OnnxReshape) and values[0] is not None:
        return torch.reshape, (tuple(values[0]),), {}
    if isinstance(layer, squeeze.OnnxSqueezeDynamicAxes) and values and values[0]:
        return torch.squeeze, (tuple(values[0]),), {}
    if isinstance(layer, unsqueeze.OnnxUnsqueezeDynamicAxes) and values and values[0] is not None and len(values[0]) == 1:
        return torch.unsqueeze, (values[0][0],), {}
    if isinstance(layer, pad.OnnxPadDynamic) and values and values[0] is not None:
        pads = pad._torch_padding_to_mode_format(pad._onnx_padding_to_torch(values[0]), layer.mode)  # noqa: SLF001  onnx2torch's own conversion
        value = float(values[1][0]) if len(values) > 1 and values[1] else 0.0
        return torch.nn.functional.pad, (), {"pad": pads, "mode": layer.mode, "value": value}
    return None


def exportable(module: Any) -> Any:
    """onnx2torch's Reshape, Squeeze, Unsqueeze and Pad read their shapes, axes or pads at run time (`.tolist()` on a
    tensor), which torch.export cannot trace (tf2onnx writes Squeeze's axes and Pad's pads as inputs); where those are
    constants of the graph, the layer becomes the torch function with them."""
    changed = False
    for node in list(module.graph.nodes):
        if node.op != "call_module" or len(node.args) < 2:
            continue
        operands = node.args[1:]
        if any(operand is not None and getattr(operand, "op", None) != "get_attr" for operand in operands):
            continue
        call = _static_call(module.get_submodule(node.target), [None if operand is None else _attribute(module, operand.target) for operand in operands])
        if call is None:
            continue
        function, arguments, keywords = call
        with module.graph.inserting_after(node):
            static = module.graph.call_function(function, (node.args[0], *arguments), keywords)
        node.replace_all_uses_with(static)
        module.graph.erase_node(node)
        changed = True
    if changed:
        module.graph.eliminate_dead_code()
        module.recompile()
    return module


def _attribute(module: Any, target: str) -> Any:
    for part in target.split("."):
        module = getattr(module, part)
    return module


def export(module: Any, example: np.ndarray, fixed_batch: bool = False) -> Any:
    """torch.export of `module` on `example` (two images or more: a batch of 1 would be specialised), its batch
    dimension left open unless the model fixes it."""
    import torch

    name = next(iter(inspect.signature(module.forward).parameters))
    dynamic = None if fixed_batch else {name: {0: torch.export.Dim("batch", max=MOST_BATCH)}}
    # Where tracing fails on a value read at run time, torch's shape solver first logs the whole graph as a warning: the
    # error below says what failed, in one line.
    shapes_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = shapes_log.level
    shapes_log.setLevel(logging.ERROR)
    try:
        return torch.export.export(module, (torch.from_numpy(example),), dynamic_shapes=dynamic)
    except Exception as error:  # torch raises UserError, GuardOnDataDependentSymNode, RuntimeError...
        raise PtqError(f"torch.export cannot capture the model ({type(error).__name__}: {first_line(error, '')})") from error
    finally:
        shapes_log.setLevel(level)


@dataclass(frozen=True)
class Options(BackendOptions, owner="PT2E", backends="pt2e, executorch"):
    """The options of the backends over this flow (pt2e, executorch)."""

    weights_from: str | None = option(
        None, cli=Path,
        help="Whose 8-bit weights the program takes: 'onnxruntime' (ptq's own onnxruntime model, made first from the same images: learned "
             "rounding, its scales, its float stem), an onnxruntime QDQ model ptq quantized from the same FP32 model, or 'none' (the "
             "PT2E flow's own rounding). (default: onnxruntime)")

    def settle(self, common: CommonChoices) -> tuple[Options, CommonChoices]:
        weights_from = str(self.weights_from) if self.weights_from is not None else MADE_HERE
        if weights_from in (MADE_HERE, NONE):
            return replace(self, weights_from=weights_from), common
        per_channel = bool(stored_settings(Path(weights_from)).get("per_channel", True))
        if common.per_channel is not None and common.per_channel != per_channel:
            given, granularity = ("--per-channel", "per-tensor") if common.per_channel else ("--per-tensor", "per-channel")
            raise PtqError(f"{given}: the weights from {weights_from} are {granularity}; leave the granularity to them")
        return replace(self, weights_from=weights_from), replace(common, per_channel=per_channel)

    def describe(self) -> str:
        return {MADE_HERE: "weights: ptq's onnxruntime model (learned rounding)", NONE: "weights: PT2E's own rounding"}.get(
            str(self.weights_from), f"weights from {self.weights_from}")

    def input_files(self) -> tuple[Path, ...]:
        return (Path(self.weights_from),) if self.weights_from not in (None, MADE_HERE, NONE) else ()


@dataclass(frozen=True)
class TorchSource:
    """The ONNX model as the PT2E flow takes it: its torch module, its input, and the calibration images in calls."""

    module: Any  # the float torch module (onnx2torch), exportable
    described: inputs.ModelInput
    fixed_batch: int | None  # the batch the graph is tied to, None where it is open
    batches: list[np.ndarray]  # the calibration images, a call each
    example: np.ndarray  # what torch.export traces with: two images (one would specialise the batch), or the fixed batch
    judged: np.ndarray  # held-out calibration images the lowering and the fidelity are judged on

    @property
    def per_call(self) -> int:
        """Images a judging call: a fixed batch takes no other."""
        return self.fixed_batch or CHUNK


CHUNK = 64  # images a call where the batch is open: activations stay in cache


def torch_source(model, calibration: np.ndarray, fold: bool) -> TorchSource:
    """The ONNX model (its graph named by its file) converted by onnx2torch and made exportable, with its calibration images."""
    model, described, fixed = torch_ready(model, Path(model.graph.name or "model"))
    module = exportable(onnx_to_graph_module(model, fold=fold))
    if fixed is None:
        batches = [calibration[start : start + CALIBRATION_BATCH] for start in range(0, len(calibration), CALIBRATION_BATCH)]
        return TorchSource(module, described, None, batches, batches[0][:2], calibration[::HELD_OUT_EVERY][:HELD_OUT_MAX])
    batches = [calibration[start : start + fixed] for start in range(0, len(calibration) - fixed + 1, fixed)]
    return TorchSource(module, described, fixed, batches, batches[0], batches[0])


@dataclass(frozen=True)
class Recipe:
    """What the quantizer is told: its target, weight granularity, activation observer, the pair rule, layers kept float."""

    per_channel: bool = True
    method: str = "histogram"
    pair_safe: bool = True  # every layer's weights under the pair rule (--cpus all), depthwise ones aside
    float_linears: bool = False  # the fully-connected layers kept in float
    target: str = X86
    depthwise: tuple[str, ...] = ()  # the depthwise convolutions (module names): exempt from the pair rule (`depthwise_modules`)
    carried: CarriedWeights | None = None  # weights carried from a QDQ model (`--weights-from`): their scales, and the layers kept float


def depthwise_modules(module: Any) -> tuple[str, ...]:
    """The depthwise convolutions of a torch module (one input and one output channel per group), by module name. oneDNN
    runs them on kernels that widen before adding, on CPUs with and without VNNI alike (measured: a 32-channel 3x3
    depthwise convolution with pairs of 127 codes under 255 gave the same scores, within float rounding, on this
    CPU's kernels and on the AVX2 ones with CPUID masked; a dense convolution with the same codes did not): the pair
    rule is not needed there, as in onnxruntime (quantize/overflow.py)."""
    import torch

    return tuple(name for name, layer in module.named_modules() if isinstance(layer, torch.nn.Conv2d) and layer.groups > 1
                 and layer.groups == layer.in_channels == layer.out_channels)


def pair_safe_observer_class(base: Any, per_channel: bool) -> Any:
    """`base` (a per-channel or per-tensor min/max weight observer, torchao's or torch.ao's) whose scales follow the pair
    rule (quantize/overflow.py): per output channel, or the largest a channel needs for the whole tensor."""
    import torch

    class PairSafeObserver(base):  # type: ignore[misc, valid-type]
        def forward(self, weight):
            self.weight_seen = weight.detach()
            return super().forward(weight)

        def calculate_qparams(self):
            rows, _ = overflow.weight_rows("Conv", self.weight_seen.float().numpy())  # Conv and Linear: output channels first
            scales = torch.from_numpy(overflow.pair_safe_scales(rows))
            if not per_channel:
                scales = scales.max().reshape(1)
            return scales, torch.zeros(len(scales), dtype=torch.int64)

    return PairSafeObserver


def _pair_safe_observer(per_channel: bool) -> Any:
    from torchao.quantization.pt2e.observer import MinMaxObserver, PerChannelMinMaxObserver

    return pair_safe_observer_class(PerChannelMinMaxObserver if per_channel else MinMaxObserver, per_channel).with_args(eps=2**-12)


def _clamps_fused(model: Any, output_spec: Any) -> None:
    """XNNPACKQuantizer fuses a ReLU into the convolution or linear layer before it, not a clamp (ReLU6, hardtanh): it
    quantizes the layer's output on its whole pre-activation range and gives the clamp that same scale, which leaves
    ReLU6 networks a few codes for 0..6 (EfficientNet-Lite0's output SQNR 2.7 dB, against 15.3 dB with the x86
    quantizer's fusion). Here a clamp whose input is such a layer's only use is annotated as a fused ReLU is: the
    layer's output left unquantized, the clamp's output observed on its own range. XNNPACK's delegate fuses the clamp
    into the layer's output bounds (FuseActivationPass)."""
    import torch
    from torchao.quantization.pt2e.quantizer import QuantizationAnnotation

    clamps = (torch.ops.aten.hardtanh.default, torch.ops.aten.hardtanh_.default)
    layers = (torch.ops.aten.conv2d.default, torch.ops.aten.conv1d.default, torch.ops.aten.convolution.default, torch.ops.aten.linear.default)
    key = "quantization_annotation"
    for node in model.graph.nodes:
        if node.op != "call_function" or node.target not in clamps or not node.args:
            continue
        layer = node.args[0]
        if getattr(layer, "target", None) not in layers or len(layer.users) != 1 or key not in layer.meta or key not in node.meta:
            continue
        layer.meta[key].output_qspec = None
        node.meta[key] = QuantizationAnnotation(input_qspec_map={}, output_qspec=output_spec, _annotated=True)


def _xnnpack_quantizer(recipe: Recipe) -> Any:
    """ExecuTorch's XNNPACKQuantizer, symmetric int8 (XNNPACK's kernels widen before adding: no pair rule), its
    activation observer as the method says, clamps fused into the layers before them (`_clamps_fused`)."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import XNNPACKQuantizer, get_symmetric_quantization_config
    from torchao.quantization.pt2e.observer import MinMaxObserver

    config = get_symmetric_quantization_config(is_per_channel=recipe.per_channel)
    if recipe.method == "minmax":
        activation = replace(config.input_activation, observer_or_fake_quant_ctr=MinMaxObserver.with_args(eps=2**-12))
        config = replace(config, input_activation=activation, output_activation=activation)

    config = _with_carried_scales(config, recipe.carried, pair_safe=False)
    floats = recipe.carried.float_layers if recipe.carried is not None else ()

    class ClampsFused(XNNPACKQuantizer):  # type: ignore[misc, valid-type]
        def annotate(self, model):
            model = super().annotate(model)
            _clamps_fused(model, config.output_activation)
            _left_float(model, floats)
            return model

    return ClampsFused().set_global(config)


def _left_float(model: Any, layers: tuple[str, ...]) -> None:
    """The nodes of these modules unannotated (XNNPACKQuantizer takes no per-module None): they compute in float, and the
    output of the activation after them, where that was quantized, is what the next layer reads."""
    from torchao.quantization.pt2e.quantizer import QuantizationAnnotation

    for node in model.graph.nodes:
        paths = {str(owner[0]) for owner in node.meta.get("nn_module_stack", {}).values()}
        if node.op == "call_function" and paths & set(layers) and "quantization_annotation" in node.meta:
            node.meta["quantization_annotation"] = QuantizationAnnotation(_annotated=True)


def _with_carried_scales(config: Any, carried: CarriedWeights | None, pair_safe: bool) -> Any:
    """The config whose weight observer hands back the scales of weights carried from a QDQ model."""
    if carried is None or not carried.weights:
        return config
    observer = config.weight.observer_or_fake_quant_ctr
    base, arguments = (observer.p.func, observer.p.keywords) if hasattr(observer, "p") else (observer, {})  # a class .with_args(...)
    return replace(config, weight=replace(config.weight, observer_or_fake_quant_ctr=carried_observer_class(base, carried, pair_safe).with_args(**arguments)))


def _quantizer(recipe: Recipe) -> Any:
    import torch
    from torchao.quantization.pt2e.observer import MinMaxObserver
    from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as x86

    if recipe.target == XNNPACK:
        return _xnnpack_quantizer(recipe)
    config = x86.get_default_x86_inductor_quantization_config()
    if recipe.method == "minmax":
        activation = replace(config.input_activation, observer_or_fake_quant_ctr=MinMaxObserver.with_args(eps=2**-12))
        config = replace(config, input_activation=activation, output_activation=activation)
    if not recipe.per_channel:
        weight = replace(config.weight, qscheme=torch.per_tensor_symmetric, ch_axis=None, observer_or_fake_quant_ctr=MinMaxObserver.with_args(eps=2**-12))
        config = replace(config, weight=weight)
    plain = _with_carried_scales(config, recipe.carried, pair_safe=False)
    if recipe.pair_safe:
        config = replace(config, weight=replace(config.weight, observer_or_fake_quant_ctr=_pair_safe_observer(recipe.per_channel)))
    config = _with_carried_scales(config, recipe.carried, recipe.pair_safe)
    quantizer = x86.X86InductorQuantizer().set_global(config)
    for name in recipe.depthwise if recipe.pair_safe else ():
        quantizer.set_module_name_qconfig(name, plain)
    for name in recipe.carried.float_layers if recipe.carried is not None else ():
        quantizer.set_module_name_qconfig(name, None)
    if recipe.float_linears:
        quantizer.set_module_type_qconfig(torch.nn.Linear, None)
        quantizer.set_function_type_qconfig(torch.nn.functional.linear, None)
    return quantizer


def _drop_unused_attributes(module: Any) -> None:
    """convert_pt2e keeps the float weights it folded into int8 constants: the program would carry both."""
    used = {str(node.target) for node in module.graph.nodes if node.op == "get_attr"}
    for name, _ in list(module.named_parameters()) + list(module.named_buffers()):
        if name not in used:
            owner, _, attribute = name.rpartition(".")
            delattr(module.get_submodule(owner) if owner else module, attribute)
    module.delete_all_unused_submodules()


def calibrated(program: Any, recipe: Recipe, batches: list[np.ndarray], progress: Callable[[int, int], None] | None = None) -> Any:
    """prepare_pt2e -> each calibration batch run -> convert_pt2e: the quantize/dequantize module."""
    import torch

    _imports()
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    prepared = prepare_pt2e(program.module(), _quantizer(recipe))
    total = sum(map(len, batches))
    with torch.no_grad():
        done = 0
        for batch in batches:
            prepared(torch.from_numpy(batch))
            done += len(batch)
            if progress is not None:
                progress(done, total)
    converted = convert_pt2e(prepared)
    _drop_unused_attributes(converted)
    return converted


# What Inductor compiles a quantized program with (`compiled`).
COMPILE_SETTINGS = {"freezing": True, "cpp_wrapper": True}


def compiled(module: Any) -> Callable[[Any], Any]:
    """The quantize/dequantize module as x86 runs it fast: torch.compile with Inductor's freezing, whose x86 passes
    (torchao's) put each quantized convolution and matrix product on oneDNN's int8 kernels and fuse the rest, and its
    C++ wrapper, which calls the kernels without Python between them (ResNet8 at batch 1: 1.76x the Python
    wrapper's speed, the same scores; docs/pytorch.md). Compiled at its first call for each batch shape (a C++ compiler
    builds the kernels and the wrapper; Inductor caches them on disk), within COMPILE_SETTINGS; a shape compiled
    already runs without entering them again. The key is what torch.compile's guards read of the call besides the
    module: the shape, and the caller's inference mode (a call under another may recompile, and without freezing
    Inductor cannot lower oneDNN's packed weights)."""
    import torch
    import torch._inductor.config as inductor

    _imports()
    program = torch.compile(module, dynamic=False)
    compiled_for: set[tuple[tuple[int, ...], bool]] = set()

    def run(batch: Any) -> Any:
        key = (tuple(batch.shape), torch.is_inference_mode_enabled())
        if key in compiled_for:
            with torch.no_grad():
                return program(batch)
        with torch.no_grad(), inductor.patch(COMPILE_SETTINGS):
            result = program(batch)
        compiled_for.add(key)
        return result

    return run


def scores(module: Any, images: np.ndarray, batch: int = 100) -> np.ndarray:
    """The module's first output (a tensor, or an array from a runtime), `batch` images a call (the last call padded to `batch`: one shape for a compiled
    module)."""
    import torch

    outputs = []
    with torch.no_grad():
        for start in range(0, len(images), batch):
            part = images[start : start + batch]
            padded = np.concatenate([part, np.zeros((batch - len(part), *part.shape[1:]), part.dtype)]) if len(part) < batch else part
            output = module(torch.from_numpy(padded))
            outputs.append((output[0] if isinstance(output, (tuple, list)) else output)[: len(part)])
    return np.concatenate([output if isinstance(output, np.ndarray) else output.float().numpy() for output in outputs])


def judge_lowering(float_module: Any, program: Any, lowered: Any, images: np.ndarray, batch: int) -> LoweringJudgement:
    """The lowered module (a module, or a function of a batch) against the quantize/dequantize program it came from
    and against FP32, run in batches of `batch` images (the lowered module's one shape)."""
    return LoweringJudgement.of(scores(float_module, images, batch), scores(program, images, batch), scores(lowered, images, batch))
