"""Where a runtime wants the QDQ writer's quantizer pairs, and its edits around them: the rule the engine (qdq.py) asks
of the runtime a model is made for, one small class per runtime. The base keeps the pairs as the writer places them;
onnxruntime's x86 kernels want some convolutions regrouped before, their pads quantized after, the ops they have no
integer kernel for rewritten into ones they have, and each int8 input's pair private to its reader. OpenVINO's CPU
plugin wants pairs only at the inputs of its integer layers, their outputs left float for its post-op fusions
(backends/openvino.py converts that model to IR)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ptq_cli.quantize import overflow
from ptq_cli.quantize.settings import (
    BackendOptions,
    CommonChoices,
    QuantizationSettings,
    option,
)
from ptq_cli.transforms.integer_forms import hard_activations_spelled_out, reduce_means_as_global_pools
from ptq_cli.transforms.qdq_edits import folded_constant_scalings, private_activation_quantizers
from ptq_cli.transforms.space_to_depth import Rewrite, quantized_pads, space_to_depth_convs


def private_int8_pairs(quantized) -> list[str]:
    added = private_activation_quantizers(quantized)
    return [f"int8 activations read by several layers: {added} QuantizeLinear/DequantizeLinear pair(s) added, one per reader, the same "
            "arithmetic (onnxruntime on x86 runs a layer on integer kernels only where its int8 input's pair has one reader)"] if added else []


@dataclass(frozen=True)
class Options(BackendOptions, owner="onnxruntime", backends="onnxruntime", article="an"):
    """onnxruntime's own options (its --help panel): what it asks of its placement."""

    space_to_depth: bool | None = option(
        None, "--space-to-depth/--no-space-to-depth", cli=bool,
        help="Regroup convolutions the fast x86 int8 kernel handles poorly (input channels not a multiple of 4, like the RGB stem; fewer than 32 "
             "output channels) over blocks of pixels along the width; same products, more zeros in the file. (default: on for uint8 activations "
             "with int8 weights, where that kernel runs)")

    def settle(self, common: CommonChoices) -> tuple[Options, CommonChoices]:
        settled = self
        if self.space_to_depth is None:  # on where it speeds the model up: uint8 activations x int8 weights
            settled = replace(self, space_to_depth=(common.dtype, common.weight_dtype) == ("uint8", "int8"))
        if common.weight_dtype == "uint8":
            common = replace(common, overflow_fix=overflow.NO_FIX)  # u8 x u8 runs on a kernel that widens to 16 bits first: nothing to fix
        return settled, common


def qdq_options(settings: QuantizationSettings) -> Options:
    return settings.options if isinstance(settings.options, Options) else Options(space_to_depth=False)


class Placement:
    """The writer's pairs as it places them: no rewrite before it, no edit after."""

    def writer_options(self, graph: Any) -> tuple[tuple[str, Any], ...]:  # noqa: ARG002  a runtime's say
        """What the writer (onnxruntime's quantize_static) is told of where pairs go in `graph` (as it is to see it):
        its `op_types_to_quantize`, nodes it leaves alone (`nodes_to_exclude`, beside the float nodes) and extra
        options; () for its own placement."""
        return ()

    def rewrite(self, graph: Any, settings: QuantizationSettings, float_nodes: list[str]) -> tuple[Any, list[Rewrite]]:  # noqa: ARG002  a runtime's say
        """The float graph as the writer is to see it, and the rewrites made (stored in the model)."""
        return graph, []

    def after_write(self, quantized: Any, rewrites: list[Rewrite]) -> None:  # noqa: ARG002  a runtime's say
        """Edits of each graph the writer made, candidates included."""

    def finished(self, quantized: Any) -> list[str]:  # noqa: ARG002  a runtime's say
        """Edits of the model kept, after its refinements; notes on what they changed."""
        return []


class OnnxruntimeX86(Placement):
    """onnxruntime's x86 int8 kernels: convolutions its fast kernel handles poorly regrouped over blocks of pixels
    where the options ask (space-to-depth), their pads quantized; whole-map ReduceMeans as GlobalAveragePool and
    HardSigmoid/HardSwish spelled out as products and sums (ops it has integer kernels for), and products by a constant
    folded into the scale before them (one QLinearMul fewer each); each int8 input's pair made private to its reader
    (a layer runs on integer kernels only where its input's pair has one reader)."""

    def rewrite(self, graph: Any, settings: QuantizationSettings, float_nodes: list[str]) -> tuple[Any, list[Rewrite]]:
        reduce_means_as_global_pools(graph)  # its integer QLinearGlobalAveragePool, where a ReduceMean runs in float
        hard_activations_spelled_out(graph)  # QLinearAdd and QLinearMul, where HardSigmoid and HardSwish run in float
        if qdq_options(settings).space_to_depth:
            return space_to_depth_convs(graph, skip=set(float_nodes))  # a float conv gains nothing
        return graph, []

    def after_write(self, quantized: Any, rewrites: list[Rewrite]) -> None:
        if rewrites:
            quantized_pads(quantized)
        folded_constant_scalings(quantized)  # x * 1/6 in HardSwish: one QLinearMul fewer, and exact

    def finished(self, quantized: Any) -> list[str]:
        return private_int8_pairs(quantized)


ONNXRUNTIME_X86 = OnnxruntimeX86()


class OpenVinoCpu(Placement):
    """OpenVINO's CPU plugin: pairs only at the inputs of the layers it runs on integer kernels (convolutions, matrix
    products) and of residual joins (an Add of two computed tensors), as NNCF places its FakeQuantize; their outputs
    stay float, so that the activations after them (ReLU, HardSwish, the squeeze-excitation's products) fuse into the
    convolution as post-ops and the next layer's input quantizer with them, instead of running as float layers between
    standalone FakeQuantizes. An Add of a constant (HardSwish's x + 3) is left to those fusions."""

    LAYERS = ("Conv", "ConvTranspose", "MatMul", "Gemm", "Add")

    def writer_options(self, graph: Any) -> tuple[tuple[str, Any], ...]:
        constants = {init.name for init in graph.graph.initializer} | {out for node in graph.graph.node if node.op_type == "Constant" for out in node.output}
        not_joins = tuple(node.name for node in graph.graph.node if node.op_type == "Add" and any(name in constants for name in node.input))
        return (("op_types_to_quantize", self.LAYERS), ("OpTypesToExcludeOutputQuantization", self.LAYERS), ("nodes_to_exclude", not_joins))


OPENVINO_CPU = OpenVinoCpu()
