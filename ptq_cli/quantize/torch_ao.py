"""The engine over torch.ao's FX quantization (`--backend pytorch`): the QConfig mapping ptq builds (observers
under the pair rule, per-image ranges, 7-bit activations), the clamps of ReLU6 outputs and the integer observers it
drops."""

from __future__ import annotations

import numpy as np

from ptq_cli.quantize import overflow, policy
from ptq_cli.quantize.pt2e import pair_safe_observer_class
from ptq_cli.quantize.settings import (
    PER_IMAGE,
    PER_IMAGE_PERCENTILE,
    QuantizationSettings,
)

X86_ENGINE = "x86"  # fbgemm-based kernels for x86 CPUs (oneDNN's for most convolutions on a CPU with AVX512-VNNI)


# How `--overflow-fix all-layers` keeps fbgemm from saturating: 8-bit activations with every layer's weights under the
# pair rule, or torch.ao's 7-bit activations (`reduce_range`). The first is judged first and kept unless the other
# measures METHOD_MARGIN_DB closer to FP32; where nothing can be judged (a fixed batch), the second, torch.ao's own.
EIGHT_BIT, SEVEN_BIT = "8", "7"


ACTIVATION_BITS = (EIGHT_BIT, SEVEN_BIT)


def _pair_safe_observer(per_channel: bool):
    """A weight observer whose scales follow the pair rule (quantize/overflow.py): per output channel, or
    one scale for the tensor (the largest a channel needs)."""
    import torch
    from torch.ao.quantization.observer import MinMaxObserver, PerChannelMinMaxObserver

    observer = pair_safe_observer_class(PerChannelMinMaxObserver if per_channel else MinMaxObserver, per_channel)
    return observer.with_args(dtype=torch.qint8, qscheme=torch.per_channel_symmetric if per_channel else torch.per_tensor_symmetric)


def _per_image_observer(percentile: float, reduce_range: bool):
    """`--method per-image` in torch.ao: an activation observer whose range is policy.per_image_range of each calibration
    image's own extremes (a tensor's first axis is the batch; one without stands for one image), so that a few images
    far out of range do not set every image's scale."""
    import torch
    from torch.ao.quantization.observer import MinMaxObserver

    class PerImageObserver(MinMaxObserver):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.image_lows: list[np.ndarray] = []
            self.image_highs: list[np.ndarray] = []

        def forward(self, x_orig):
            if x_orig.numel() == 0:
                return x_orig
            values = x_orig.detach().to(self.min_val.dtype)
            lows, highs = torch.aminmax(values.reshape(values.shape[0] if values.dim() > 1 else 1, -1), dim=1)
            self.image_lows.append(lows.numpy())
            self.image_highs.append(highs.numpy())
            low, high = policy.per_image_range(np.concatenate(self.image_lows), np.concatenate(self.image_highs), percentile)
            self.min_val.copy_(torch.tensor(low))  # what calculate_qparams, and torch.ao reading the observer, see
            self.max_val.copy_(torch.tensor(high))
            return x_orig

    return PerImageObserver.with_args(dtype=torch.quint8, reduce_range=reduce_range)


def qconfig_mapping(per_channel: bool, method: str, overflow_fix: str = overflow.NO_FIX, first_layers: tuple[str, ...] = (),  # noqa: PLR0913  one keyword each
                    float_stem: bool = False, float_modules: tuple[str, ...] = (), percentile: float | None = None,
                    activation_bits: str = SEVEN_BIT):
    """Weights: signed int8, symmetric (the x86 quantized kernels need that). Activations: unsigned 8-bit.

    fbgemm without VNNI adds pairs of u8 x s8 products into a saturating int16 (`--cpus all`), its depthwise kernel
    too: "all-layers" keeps 7-bit activations (`activation_bits` "7": torch.ao's own x86 default, `reduce_range`;
    2 * 127 * 128 never overflows) or gives every layer's weights pair-safe scales ("8": 255 * 128 never overflows);
    "first-layer" gives the `first_layers` modules' weights pair-safe scales and keeps 8-bit activations;
    with `float_stem` they stay in float instead (the image then meets no int8 weights). `float_modules` stay in float.
    `percentile`: of `--method per-image`.
    """
    import torch
    from torch.ao.quantization import QConfig, get_default_qconfig_mapping
    from torch.ao.quantization.observer import HistogramObserver, MinMaxObserver, PerChannelMinMaxObserver

    weight = (
        PerChannelMinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
        if per_channel
        else MinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
    )
    reduce_range = overflow_fix == overflow.ALL_LAYERS and activation_bits == SEVEN_BIT
    if overflow_fix == overflow.ALL_LAYERS and not reduce_range:
        weight = _pair_safe_observer(per_channel)
    if method == PER_IMAGE:
        activation = _per_image_observer(PER_IMAGE_PERCENTILE if percentile is None else percentile, reduce_range)
    else:
        activation = (HistogramObserver if method == "histogram" else MinMaxObserver).with_args(dtype=torch.quint8, reduce_range=reduce_range)
    # The x86 mapping keeps its fixed-range settings for ops like softmax; everything else gets ours.
    mapping = get_default_qconfig_mapping(X86_ENGINE).set_global(QConfig(activation=activation, weight=weight))
    for name in float_modules:
        mapping.set_module_name(name, None)
    if float_stem:
        for name in first_layers:
            mapping.set_module_name(name, None)
    elif overflow_fix == overflow.FIRST_LAYER:
        for name in first_layers:
            mapping.set_module_name(name, QConfig(activation=activation, weight=_pair_safe_observer(per_channel)))
    return mapping


def activation_bits(settings: QuantizationSettings) -> str:
    """The activations' bits `--overflow-fix all-layers` keeps: as given or measured, else torch.ao's 7."""
    return getattr(settings.options, "activation_bits", None) or SEVEN_BIT


def seven_bit_activations(stored: dict | None) -> bool:
    """Whether a model's stored settings keep 7-bit activations (ptq before `--activation-bits` stored none: 7)."""
    stored = stored or {}
    return stored.get("overflow_fix") == overflow.ALL_LAYERS and stored.get("activation_bits") != EIGHT_BIT


def clamp_bounds(module) -> tuple[float, float] | None:
    """(low, high) of a clamping activation from 0 whose quantized output can simply be its input's
    (ReLU6, a Hardtanh(0, 6), and other Hardtanh from 0), else None."""
    import torch

    if isinstance(module, torch.nn.Hardtanh) and module.min_val == 0 and module.max_val > 0:
        return 0.0, float(module.max_val)
    return None


def _module_of(graph_module, value, types):
    """The module a graph value is the output of, if it is a call to one of `types`, else None."""
    import torch

    if not isinstance(value, torch.fx.Node) or value.op != "call_module":
        return None
    module = graph_module.get_submodule(value.target)
    return module if isinstance(module, types) else None


def clamp_conv_outputs(prepared, reduce_range: bool) -> list[str]:
    """Give each Conv/Linear output that feeds only a ReLU6 (onnx2torch's Clip(0, 6)) the activation's
    range, fixed: the quantized convolution then clamps as ReLU6 does, at 6/255 a code.

    torch.ao shares ReLU6's quantization parameters with its input, so without this the convolution's
    output is quantized over its whole range (-93..90 at an EfficientNet stem: 8 codes for 0..6). The
    observer is replaced after prepare_fx rather than set in the QConfig, since a module's QConfig also
    observes its *input*, which would clip a normalised image to [0, 6]. Returns the modules clamped."""
    import torch
    from torch.ao.quantization.observer import FixedQParamsObserver, ObserverBase

    clamped = []
    quant_max = 127 if reduce_range else 255
    for node in prepared.graph.nodes:
        clamp = _module_of(prepared, node, torch.nn.Hardtanh)
        bounds = clamp_bounds(clamp) if clamp is not None else None
        if bounds is None or not node.args:
            continue
        observed = node.args[0]
        if _module_of(prepared, observed, ObserverBase) is None or len(observed.users) != 1:
            continue
        source = observed.args[0]
        if _module_of(prepared, source, (torch.nn.Conv2d, torch.nn.Linear)) is None:
            continue
        low, high = bounds
        fixed = FixedQParamsObserver(scale=(high - low) / quant_max, zero_point=0, dtype=torch.quint8, quant_min=0, quant_max=quant_max)
        prepared.add_submodule(observed.target, fixed)
        clamped.append(str(source.target))
    prepared.recompile()
    return clamped


def drop_integer_observers(prepared, example) -> list[str]:
    """Remove the observers prepare_fx put on integer tensors (the int64 shapes and pads of a tf2onnx graph,
    which onnx2torch computes at run time): torch.ao cannot observe or quantize them, and they are not
    activations. Found by running `example` once; returns the observers removed."""
    import torch
    from torch.ao.quantization.observer import ObserverBase

    seen: dict[str, torch.dtype] = {}

    class Recorder(torch.nn.Module):  # stands in for an observer during the probe: notes the dtype, passes the tensor on
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

        def forward(self, value):
            if isinstance(value, torch.Tensor):
                seen.setdefault(self.name, value.dtype)
            return value

    observers = {name: module for name, module in prepared.named_modules() if isinstance(module, ObserverBase)}
    for name in observers:
        prepared.set_submodule(name, Recorder(name))
    try:
        with torch.no_grad():
            prepared(example)
    finally:
        for name, module in observers.items():
            prepared.set_submodule(name, module)
    dropped = []
    for node in list(prepared.graph.nodes):
        if node.op == "call_module" and str(node.target) in seen and not seen[str(node.target)].is_floating_point:
            node.replace_all_uses_with(node.args[0])
            prepared.graph.erase_node(node)
            dropped.append(str(node.target))
    if dropped:
        prepared.graph.lint()
        prepared.recompile()
    return dropped
