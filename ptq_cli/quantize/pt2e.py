"""The engine over torchao's PT2E quantization (`--backend pt2e`): a torch module exported with torch.export, annotated
by torchao's X86InductorQuantizer, calibrated on ptq's calibration images, converted to a quantize/dequantize program,
then compiled for x86 (torch.compile, Inductor's freezing passes: oneDNN's int8 kernels, the rest fused) and judged
after compiling: a lowering that changes what the program computes is refused, not shipped.

What the flow carries of ptq's choices: per-channel or per-tensor weights, the activation observer (histogram or
minmax), the pair rule on every layer's weights for a model right on every x86 CPU (`--cpus all`: no pair of u8 x s8
products overflows the int16 sums of CPUs without VNNI, whatever the kernel's order; 7-bit activations would not do,
since the lowered kernels requantize to the whole 0-255), and fully-connected layers kept in float where lowering
them loses fidelity. What it does not (yet): searched ranges, per-image ranges and learned rounding, which ptq writes
into ONNX QDQ models.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ptq_cli.errors import PtqError, first_line
from ptq_cli.metrics import sqnr_db
from ptq_cli.quantize import overflow

METHODS = ("histogram", "minmax")
MOST_BATCH = 65_536  # the batch dimension of an exported program: open up to this
# The compiled program must compute what the quantize/dequantize program computes: output SQNR between the two, on
# held-out calibration images, at least this (rounding differences between the reference ops and oneDNN's kernels
# stay far above it; a wrong kernel falls far below: ResNet8's classifier, 86.7% top-1 before lowering, 16% after).
LOWERING_SQNR_DB = 25.0


def _imports() -> None:
    """torchao's PT2E modules, which also register the quantized_decomposed operators a program calls."""
    import torchao.quantization.pt2e.quantize_pt2e  # noqa: F401


def exportable(module: Any) -> Any:
    """onnx2torch's Reshape reads its target shape at run time and branches on it, which torch.export cannot trace;
    where the target is a constant of the graph, the module becomes torch.reshape with that shape."""
    import torch
    from onnx2torch.node_converters.reshape import OnnxReshape

    changed = False
    for node in list(module.graph.nodes):
        if node.op != "call_module" or not isinstance(module.get_submodule(node.target), OnnxReshape) or len(node.args) != 2:
            continue
        shape_node = node.args[1]
        if getattr(shape_node, "op", None) != "get_attr":
            continue
        shape = module
        for part in str(shape_node.target).split("."):
            shape = getattr(shape, part)
        with module.graph.inserting_after(node):
            reshaped = module.graph.call_function(torch.reshape, (node.args[0], tuple(int(value) for value in shape)))
        node.replace_all_uses_with(reshaped)
        module.graph.erase_node(node)
        changed = True
    if changed:
        module.graph.eliminate_dead_code()
        module.recompile()
    return module


def export(module: Any, example: np.ndarray, fixed_batch: bool = False) -> Any:
    """torch.export of `module` on `example` (two images or more: a batch of 1 would be specialised), its batch
    dimension left open unless the model fixes it."""
    import torch

    name = next(iter(inspect.signature(module.forward).parameters))
    dynamic = None if fixed_batch else {name: {0: torch.export.Dim("batch", max=MOST_BATCH)}}
    try:
        return torch.export.export(module, (torch.from_numpy(example),), dynamic_shapes=dynamic)
    except Exception as error:  # torch raises UserError, GuardOnDataDependentSymNode, RuntimeError...
        raise PtqError(f"torch.export cannot capture the model ({type(error).__name__}: {first_line(error, '')})") from error


@dataclass(frozen=True)
class Recipe:
    """What the quantizer is told: weight granularity, activation observer, the pair rule, layers kept float."""

    per_channel: bool = True
    method: str = "histogram"
    pair_safe: bool = True  # every layer's weights under the pair rule (--cpus all)
    float_linears: bool = False  # the fully-connected layers kept in float


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


def _quantizer(recipe: Recipe) -> Any:
    import torch
    from torchao.quantization.pt2e.observer import MinMaxObserver
    from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as x86

    config = x86.get_default_x86_inductor_quantization_config()
    if recipe.method == "minmax":
        activation = replace(config.input_activation, observer_or_fake_quant_ctr=MinMaxObserver.with_args(eps=2**-12))
        config = replace(config, input_activation=activation, output_activation=activation)
    if not recipe.per_channel:
        weight = replace(config.weight, qscheme=torch.per_tensor_symmetric, ch_axis=None, observer_or_fake_quant_ctr=MinMaxObserver.with_args(eps=2**-12))
        config = replace(config, weight=weight)
    if recipe.pair_safe:
        config = replace(config, weight=replace(config.weight, observer_or_fake_quant_ctr=_pair_safe_observer(recipe.per_channel)))
    quantizer = x86.X86InductorQuantizer().set_global(config)
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


def compiled(module: Any) -> Callable[[Any], Any]:
    """The quantize/dequantize module as x86 runs it fast: torch.compile with Inductor's freezing, whose x86 passes
    (torchao's) put each quantized convolution and matrix product on oneDNN's int8 kernels and fuse the rest. Compiled
    at its first call for each batch shape (a C++ compiler builds the fused kernels; Inductor caches them on disk)."""
    import torch
    import torch._inductor.config as inductor

    _imports()
    program = torch.compile(module, dynamic=False)

    def run(batch: Any) -> Any:
        with torch.no_grad(), inductor.patch(freezing=True):
            return program(batch)

    return run


def scores(module: Any, images: np.ndarray, batch: int = 100) -> np.ndarray:
    """The module's first output, `batch` images a call (the last call padded to `batch`: one shape for a compiled
    module)."""
    import torch

    outputs = []
    with torch.no_grad():
        for start in range(0, len(images), batch):
            part = images[start : start + batch]
            padded = np.concatenate([part, np.zeros((batch - len(part), *part.shape[1:]), part.dtype)]) if len(part) < batch else part
            output = module(torch.from_numpy(padded))
            outputs.append((output[0] if isinstance(output, (tuple, list)) else output)[: len(part)])
    return np.concatenate([output.float().numpy() for output in outputs])


def lowering_sqnr(reference: Any, lowered_module: Any, images: np.ndarray, batch: int) -> float:
    """Output SQNR of the compiled module against the quantize/dequantize program it was compiled from, run in
    batches of `batch` images (the compiled module's one shape)."""
    return sqnr_db(scores(reference, images, batch), scores(lowered_module, images, batch))
