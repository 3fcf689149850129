"""PyTorch: ONNX -> torch.fx with onnx2torch, FX graph-mode int8 quantization (x86), TorchScript files."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from ptq_cli import inputs
from ptq_cli.backends import base
from ptq_cli.backends.base import Backend, LoadedModel, Quantizer, RunOptions, Runtime, describe_settings, finish_load
from ptq_cli.errors import PtqError, first_line
from ptq_cli.guards import bounded, trust
from ptq_cli.guards.atomic import atomic_output
from ptq_cli.metrics import sqnr_db
from ptq_cli.model_file import in_fixed_batches, metadata_object, read_bytes, resolve_threads
from ptq_cli.quantize import overflow, policy, torch_ao
from ptq_cli.quantize.settings import (
    AUTO_METHOD,
    HELD_OUT_EVERY,
    HELD_OUT_MAX,
    PER_IMAGE,
    PER_IMAGE_PERCENTILE,
    PER_IMAGE_TIGHT_PERCENTILE,
    BackendOptions,
    CommonChoices,
    ProgressCallback,
    QuantizationSettings,
    QuantizeCall,
    QuantizedFile,
    option,
)
from ptq_cli.quantize.torch_ao import (
    ACTIVATION_BITS,
    EIGHT_BIT,
    SEVEN_BIT,
    activation_bits,
    clamp_conv_outputs,
    drop_integer_observers,
    qconfig_mapping,
    seven_bit_activations,
)
from ptq_cli.quantize.torch_graph import onnx_to_graph_module, torch_ready
from ptq_cli.transforms.torch_compat import import_onnx2torch
from ptq_cli.x86 import paths as int8_paths
from ptq_cli.x86.cpu import SATURATING

NAME = "pytorch"
SUFFIX = ".pt"
# PyTorch deprecates every layer of this path (torch.ao.quantization, its quantized tensors, TorchScript): said with every model.
DEPRECATED = ("deprecated: torch.ao FX quantization and TorchScript are deprecated by PyTorch; --backend pytorch goes in ptq 0.6 "
              "(use --backend pt2e for x86, --backend executorch for phones and ARM)")
ENGINE = torch_ao.X86_ENGINE
SATURATING_ENGINE = "fbgemm"  # the kernels a CPU without VNNI runs
ZIP_MAGIC = b"PK\x03\x04"  # TorchScript files are zip archives
# ptq's metadata inside a TorchScript archive, as this extra file: the same keys as in ONNX metadata.
TORCHSCRIPT_METADATA_FILE = "ptq.json"
MODEL_INPUT_KEY = "ptq.model_input"
CALIBRATION_BATCH = 100
# TorchScript runs a large batch in chunks of at most this many images, whose activations stay in
# cache (see docs, "Speed": about 3x the throughput of whole 1,024-image batches).
TORCH_CHUNK = 64
# Tried, in order, on a TorchScript file ptq did not make (which says nothing of its input).
PROBE_INPUTS = (inputs.ModelInput("input", inputs.NCHW, 3, 32, 32, None), inputs.ModelInput("input", inputs.NHWC, 3, 32, 32, None))


def _warn_if_quantized(data: bytes) -> None:
    """torch 2.13 deprecates the quantized tensors a quantized TorchScript model holds (pytorch#184982), once a process,
    from its C++ side: run by the TorchScript interpreter, that warning is a raw line in the middle of ptq's progress;
    called from Python first, it is a Python warning, which the command shows after its output (and the interpreter's
    runs then say it no more)."""
    import torch

    if b"torch.classes.quantized" in data:  # its packed quantized weights, named in the archive's pickles
        torch.quantize_per_tensor(torch.zeros(1), 1.0, 0, torch.quint8)


def sniff(head: bytes) -> bool:
    return head.startswith(ZIP_MAGIC)


def save_torchscript(module, path: Path, example: np.ndarray, stored: dict[str, str], described: inputs.ModelInput) -> None:
    """Trace to TorchScript (loads without this project's code) with ptq's metadata inside the file."""
    import torch

    # The tracer may warn that Reshape's target becomes a constant: static_reshape_targets made it [-1, ...] beforehand,
    # so the trace holds for any batch size (the conversion check runs 1000 images); its warning is shown, not hidden.
    with torch.no_grad():
        scripted = torch.jit.trace(module, torch.from_numpy(example), check_trace=False)
    # Saved through a buffer: given a path, torch names the archive's root folder after the file, so
    # the temporary name would make two identical models differ byte for byte.
    buffer = io.BytesIO()
    contents = {**stored, MODEL_INPUT_KEY: json.dumps(asdict(described))}
    torch.jit.save(scripted, buffer, _extra_files={TORCHSCRIPT_METADATA_FILE: json.dumps(contents, sort_keys=True)})
    Path(path).write_bytes(buffer.getvalue())
    trust.remember(buffer.getvalue())


def first_layer_modules(module) -> list[str]:
    """The Conv/Linear modules the input reaches without passing another one (the stem), by name."""
    import torch

    weighted = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Linear)
    frontier = [node for node in module.graph.nodes if node.op == "placeholder"]
    seen, found = set(frontier), []
    while frontier:
        for user in frontier.pop().users:
            if user.op == "call_module" and isinstance(module.get_submodule(user.target), weighted):
                if user.target not in found:
                    found.append(user.target)
            elif user not in seen:
                seen.add(user)
                frontier.append(user)
    return found


def _averages_whole_maps(module) -> bool:
    """A module that averages over space: torch's average pools, onnx2torch's GlobalAveragePool and ReduceMean."""
    import torch

    pools = (torch.nn.AvgPool1d, torch.nn.AvgPool2d, torch.nn.AvgPool3d, torch.nn.AdaptiveAvgPool1d, torch.nn.AdaptiveAvgPool2d,
             torch.nn.AdaptiveAvgPool3d)
    name = type(module).__name__
    return isinstance(module, pools) or name.startswith("OnnxGlobalAveragePool") or getattr(module, "operation_type", None) == "ReduceMean"


def whole_map_pools(module, example) -> list[str]:
    """The averaging modules that leave one value per channel on `example` (a global average pool, however written):
    torch.ao gives a pool's or a mean's output its input's quantization parameters, so the pooled features would
    keep a few codes of the whole maps' range; left in float, the next layer observes them on their own."""
    import torch
    from torch.fx.passes.shape_prop import ShapeProp

    try:
        with torch.no_grad():
            ShapeProp(module).propagate(example)
    except Exception:  # noqa: BLE001  a graph shape propagation cannot run: its pools stay as torch.ao quantizes them
        return []
    found = []
    for node in module.graph.nodes:
        if node.op != "call_module" or not _averages_whole_maps(module.get_submodule(node.target)) or not node.args:
            continue
        source = getattr(node.args[0], "meta", {}).get("tensor_meta")
        result = node.meta.get("tensor_meta")
        if source is None or result is None or len(source.shape) < 3:
            continue
        values, channels = int(np.prod(result.shape[1:])), {source.shape[1], source.shape[-1]}
        if values in channels and values < int(np.prod(source.shape[1:])):
            found.append(node.target)
    return found


def _batches(images: np.ndarray, fixed: int | None) -> list[np.ndarray]:
    if fixed is None:
        return [images[start : start + CALIBRATION_BATCH] for start in range(0, len(images), CALIBRATION_BATCH)]
    return [images[start : start + fixed] for start in range(0, len(images) - fixed + 1, fixed)]


def _scores(module, images: np.ndarray, fixed: int | None) -> np.ndarray:
    """The module's (first) output on `images`, a calibration batch at a time."""
    import torch

    with torch.no_grad():
        outputs = [module(torch.from_numpy(batch)) for batch in _batches(images, fixed)]
    return np.concatenate([(output[0] if isinstance(output, (tuple, list)) else output).numpy() for output in outputs])


# `--method auto`: torch.ao's observers, each judged on held-out calibration images; the first is kept unless another
# measures METHOD_MARGIN_DB better.
METHOD_CANDIDATES = (("histogram", None), ("minmax", None), (PER_IMAGE, PER_IMAGE_PERCENTILE),
                     (PER_IMAGE, PER_IMAGE_TIGHT_PERCENTILE))


def output_softmax_modules(module) -> list[str]:
    """The Softmax modules whose output is the graph's: kept float, as onnxruntime's are. torch.ao's x86 mapping gives
    a Softmax fixed output ranges, and a Reshape between the scores and it then takes those (0 to 1) for the scores:
    a Keras MobileNetV3-Small's 10 scores reached the Softmax clipped to 0..1 (1.4 dB, 27% top-1 agreement). Before
    opset 13 onnx2torch writes its own Softmax module, which torch.ao leaves float already."""
    import torch

    import_onnx2torch()
    from onnx2torch.node_converters.activations import OnnxSoftmaxV1V11

    output = next(node for node in module.graph.nodes if node.op == "output")
    returned = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    return [node.target for node in returned if getattr(node, "op", None) == "call_module"
            and isinstance(module.get_submodule(node.target), (torch.nn.Softmax, torch.nn.LogSoftmax, OnnxSoftmaxV1V11))]


def _scores_module(module):
    """A copy of the module returning the scores its output Softmax reads (the module itself where none): what
    `--method auto` judges, as onnxruntime's judge reads the scores before a final Softmax."""
    import copy

    softmax = set(output_softmax_modules(module))
    output = next(node for node in module.graph.nodes if node.op == "output")
    first = output.args[0][0] if isinstance(output.args[0], (tuple, list)) else output.args[0]
    if getattr(first, "target", None) not in softmax:
        return module
    scores = copy.deepcopy(module)
    returned = next(node for node in scores.graph.nodes if node.op == "output")
    node = returned.args[0][0] if isinstance(returned.args[0], (tuple, list)) else returned.args[0]
    returned.args = (node.args[0],)
    scores.graph.eliminate_dead_code()
    scores.recompile()
    return scores


def _calibrated(float_module, settings: QuantizationSettings, batches: list[np.ndarray], example, float_modules: tuple[str, ...],
                progress: ProgressCallback | None = None):
    """prepare_fx -> calibrate on `batches` -> convert_fx of a copy of the float module, with the settings' observers."""
    import copy

    import torch
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    mapping = qconfig_mapping(bool(settings.per_channel), settings.method, settings.overflow_fix or overflow.NO_FIX,
                              tuple(first_layer_modules(float_module)), float_stem=settings.stem == "float", float_modules=float_modules,
                              percentile=settings.percentile, activation_bits=activation_bits(settings))
    prepared = prepare_fx(copy.deepcopy(float_module), mapping, (example,))
    drop_integer_observers(prepared, example)
    clamp_conv_outputs(prepared, seven_bit_activations(settings.as_dict()))
    with torch.no_grad():
        for index, batch in enumerate(batches):
            if progress is not None:
                progress(index * len(batches[0]), sum(map(len, batches)))
            prepared(torch.from_numpy(batch))  # observers keep running statistics: one batch held at a time
    return convert_fx(prepared)


def _with_bits(settings: QuantizationSettings, bits: str) -> QuantizationSettings:
    options = settings.options if isinstance(settings.options, Options) else Options()
    return replace(settings, options=replace(options, activation_bits=bits))


def _bits_open(settings: QuantizationSettings) -> bool:
    """Whether the activations' bits are still to be measured: all-layers, `--activation-bits` not given."""
    return settings.overflow_fix == overflow.ALL_LAYERS and getattr(settings.options, "activation_bits", None) is None


def _variants(settings: QuantizationSettings) -> tuple[QuantizationSettings, QuantizationSettings | None]:
    """(the settings preferred, the other one judged against them, or None): for all-layers, 8-bit activations under
    the pair rule against 7-bit; for a judged fix (overflow.JUDGED), all-layers (proven) against first-layer."""
    if settings.overflow_fix == overflow.JUDGED:
        return _with_bits(replace(settings, overflow_fix=overflow.ALL_LAYERS), EIGHT_BIT), replace(settings, overflow_fix=overflow.FIRST_LAYER)
    if _bits_open(settings):
        return _with_bits(settings, EIGHT_BIT), _with_bits(settings, SEVEN_BIT)
    return settings, None


def _unjudged(settings: QuantizationSettings) -> QuantizationSettings:
    """The settings where no held-out images judge them (a fixed batch): the first method, and as before the choice
    existed, torch.ao's 7 bits for all-layers and first-layer for a judged fix."""
    if settings.method == AUTO_METHOD:
        settings = replace(settings, method=METHOD_CANDIDATES[0][0], percentile=METHOD_CANDIDATES[0][1])
    if settings.overflow_fix == overflow.JUDGED:
        return replace(settings, overflow_fix=overflow.FIRST_LAYER)
    return _with_bits(settings, SEVEN_BIT) if _bits_open(settings) else settings


@contextlib.contextmanager
def _made_before_not_scanned() -> Iterator[None]:
    """The collections after each candidate scan only what was made since (gc.freeze): torch's own objects are so many
    that a full collection took 0.3 s, longer than a candidate of a small model. One full collection first: garbage
    frozen with the living would stay until the end (the float graph's conversion leaves some). A process that froze
    objects of its own (a server using ptq's API) keeps them frozen: nothing is frozen or unfrozen there."""
    import gc

    if gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _choose_by_held_out(float_module, settings: QuantizationSettings, calibration: np.ndarray, example, float_modules: tuple[str, ...],
                        progress: ProgressCallback | None) -> tuple[QuantizationSettings, tuple[str, ...]]:
    """`--method auto`, the activations' bits of all-layers and a judged overflow fix: each candidate calibrated on 3/4
    of the calibration images and judged by the image SQNR of the scores against FP32 on the other 1/4. The methods
    (METHOD_CANDIDATES) first, with the preferred variant (`_variants`); then the other variant with the method kept,
    kept only where it is METHOD_MARGIN_DB closer. (settings, notes)."""
    import gc

    from ptq_cli.metrics import image_sqnr_db

    held_out, rest = policy.held_out_split(calibration)
    if len(held_out) == 0 or len(rest) == 0:
        return _unjudged(settings), ()
    reference = _scores(_scores_module(float_module), held_out, None)
    preferred, other = _variants(settings)
    methods = ([replace(preferred, method=method, percentile=percentile) for method, percentile in METHOD_CANDIDATES]
               if settings.method == AUTO_METHOD else [preferred])
    figures: list[float | None] = []

    def judge(candidate: QuantizationSettings) -> float | None:
        index, count = len(figures), len(methods) + (other is not None)
        step = (lambda done, _total: progress(index * len(rest) + done, count * len(rest))) if progress else None
        calibrated = _calibrated(float_module, candidate, _batches(rest, None), example, float_modules, step)
        figures.append(policy.sqnr_figure(image_sqnr_db(reference, _scores(_scores_module(calibrated), held_out, None))))
        del calibrated
        gc.collect()  # FX graph modules hold reference cycles: each candidate's copies go before the next is made
        return figures[-1]

    for candidate in methods:
        judge(candidate)
    if settings.method == AUTO_METHOD:
        scores = tuple((method, percentile, figure) for (method, percentile), figure in zip(METHOD_CANDIDATES, figures, strict=True))
        method, percentile = policy.chosen_method(scores)
        preferred = replace(preferred, method=method, percentile=percentile).with_evidence(method_sqnr_db=scores)
    if other is None:
        return preferred, ()
    preferred_db = figures[[(c.method, c.percentile) for c in methods].index((preferred.method, preferred.percentile))]
    other = replace(preferred, overflow_fix=other.overflow_fix, options=other.options)  # with the method kept
    other_db = judge(other)
    kept = other if policy.closer_by_margin(other_db, preferred_db) else preferred
    if settings.overflow_fix == overflow.JUDGED:  # preferred: all-layers, the other first-layer
        return kept.with_evidence(overflow_fix_db=((overflow.ALL_LAYERS, preferred_db), (overflow.FIRST_LAYER, other_db))), ()
    return kept, (f"activations {activation_bits(kept)}-bit (image SQNR on held-out calibration images: 8-bit activations with "  # preferred: 8
                  f"pair-safe weights {_db(preferred_db)}, 7-bit activations {_db(other_db)})",)


def _db(figure: float | None) -> str:
    return "n/a" if figure is None else f"{figure:.1f} dB"


def quantize(call: QuantizeCall) -> QuantizedFile:
    """prepare_fx -> calibrate -> convert_fx, saved as TorchScript (NCHW and NHWC models alike); `--method auto`
    first chooses the observers, and all-layers the activations' bits, on held-out calibration images (not where the
    graph is tied to a fixed batch)."""
    model, output, settings, calibration, stored, progress = call.model, call.output, call.settings, call.calibration, call.stored, call.progress
    import torch

    if getattr(settings.options, "activation_bits", None) is not None:
        if settings.overflow_fix == overflow.JUDGED:  # the bits say how every layer is kept safe: all-layers asked for
            settings = replace(settings, overflow_fix=overflow.ALL_LAYERS)
        if settings.overflow_fix != overflow.ALL_LAYERS:
            raise PtqError("--activation-bits: applies to --overflow-fix all-layers (on --cpus all, the default for a model with ReLU6, "
                           "and judged for the others); PyTorch's other models keep 8-bit activations")

    torch.backends.quantized.engine = ENGINE
    model, described, fixed = torch_ready(model, Path(model.graph.name or "model"))
    float_module = onnx_to_graph_module(model, fold=settings.preprocess)
    batches = _batches(calibration, fixed)
    example = torch.from_numpy(batches[0][:1] if fixed is None else batches[0])
    pools = whole_map_pools(float_module, example)
    float_modules = (*pools, *output_softmax_modules(float_module))
    chosen: tuple[str, ...] = ()
    if settings.method == AUTO_METHOD or _variants(settings)[1] is not None:
        if fixed is not None:
            settings = _unjudged(settings)
        else:
            with _made_before_not_scanned():
                settings, chosen = _choose_by_held_out(float_module, settings, calibration, example, float_modules, progress)
    judged = calibration[:: HELD_OUT_EVERY][: HELD_OUT_MAX] if fixed is None else batches[0]
    reference = _scores(float_module, judged, fixed)
    quantized = _calibrated(float_module, settings, batches, example, float_modules, progress)
    extra = bounded.json_loads(stored.pop(base.QUANTIZATION_METADATA_KEY, "{}"))
    contents = {**stored, base.QUANTIZATION_METADATA_KEY: json.dumps({**settings.as_dict(), **extra})}
    with atomic_output(output) as tmp:
        save_torchscript(quantized, tmp, batches[0][: 8 if fixed is None else fixed], contents, described)
        size = tmp.stat().st_size
    fidelity = sqnr_db(reference, _scores(quantized, judged, fixed))
    # torch.ao can lose a network outright where onnxruntime does not: said at once.
    notes = [f"output SQNR against FP32 on {len(judged)} calibration images: {fidelity:.1f} dB", *chosen, *policy.pools_in_float_note(pools, "torch.ao"),
             DEPRECATED]
    if described.batch is not None and fixed is None:
        notes.append(f"fixed batch {described.batch} made symbolic (same outputs)")
    return QuantizedFile(size, (), tuple(notes), settings=settings)


def _read_metadata(raw: str) -> dict:
    try:
        data = bounded.json_loads(raw or "{}")
    except ValueError:
        return {}
    if not isinstance(data, dict):
        return {}
    if "dtype" in data and base.QUANTIZATION_METADATA_KEY not in data:  # ptq 0.2's flat form: the settings themselves
        return {base.QUANTIZATION_METADATA_KEY: json.dumps(data)} if data.get("dtype") != "fp32" else {}
    return data


def load(path: Path, options: RunOptions) -> LoadedModel:
    import torch

    path = Path(path)
    threads = resolve_threads(options.threads)
    data = read_bytes(path)
    trust.require(path, data, "TorchScript")
    extra_files = {TORCHSCRIPT_METADATA_FILE: ""}
    _warn_if_quantized(data)
    try:
        with _quantized_engine(SATURATING_ENGINE if options.saturating_int8 else ENGINE):
            module = torch.jit.load(io.BytesIO(data), map_location="cpu", _extra_files=extra_files)
    except Exception as error:  # torch raises RuntimeError, ValueError or zip errors for a damaged archive
        raise PtqError(f"{path}: not a loadable TorchScript model ({first_line(error)})") from error
    module.eval()
    stored = _read_metadata(extra_files[TORCHSCRIPT_METADATA_FILE])
    quantization = metadata_object(path, stored, base.QUANTIZATION_METADATA_KEY)
    dtype = (quantization or {}).get("dtype") or ("int8" if "quantize_per_tensor" in module.inlined_graph.str() else "fp32")
    torch.set_num_threads(threads)

    def call(batch: np.ndarray) -> np.ndarray:
        result = module(torch.from_numpy(batch))
        if isinstance(result, (tuple, list)) and result:
            result = result[0]
        if not isinstance(result, torch.Tensor):
            raise PtqError(f"{path}: returns {type(result).__name__}, not a tensor of class scores")
        return result.float().numpy()

    def predict(batch: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            if len(batch) <= TORCH_CHUNK:
                return call(batch)
            return np.concatenate([call(chunk) for chunk in np.array_split(batch, -(-len(batch) // TORCH_CHUNK))])

    candidates: tuple[inputs.ModelInput, ...] = PROBE_INPUTS
    if MODEL_INPUT_KEY in stored:
        with contextlib.suppress(ValueError, TypeError):  # unreadable: probe the usual layouts
            candidates = (inputs.ModelInput(**bounded.json_loads(stored[MODEL_INPUT_KEY])),)
    described, probe = _probe_input(path, predict, candidates)
    if probe.ndim != 2:
        raise PtqError(f"{path}: output shape {list(probe.shape)} is not N x classes")
    fixed = described.batch
    if fixed is not None:
        whole = predict

        def predict(batch: np.ndarray) -> np.ndarray:  # noqa: F811  a traced fixed batch: chunks of it
            return in_fixed_batches(whole, batch, fixed)

    return finish_load(path, BACKEND, options, described=described, predict=predict, dtype=dtype, size_bytes=len(data),
                       sha256=hashlib.sha256(data).hexdigest(), stored=stored, declared_classes=int(probe.shape[1]), quantization=quantization)


@contextlib.contextmanager
def _quantized_engine(name: str):
    """torch's quantized engine `name` for the block: the engine at load time packs the weights, and the packing picks
    the kernels (x86: oneDNN's or fbgemm's)."""
    import torch

    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = before


def _probe_input(path: Path, predict, candidates: tuple[inputs.ModelInput, ...]) -> tuple[inputs.ModelInput, np.ndarray]:
    """The first input contract the TorchScript module runs (TorchScript declares no shapes), and its scores."""
    cause = ""
    for candidate in candidates:
        try:
            return candidate, predict(np.zeros(candidate.shape(candidate.batch or 1), dtype=np.float32))
        except RuntimeError as error:
            # A TorchScript error is a stack of frames; its last line says what went wrong.
            cause = ([line for line in str(error).splitlines() if line.strip()][-1:] or [type(error).__name__])[0].strip()
    shapes = " or ".join("x".join(map(str, c.shape(1))) for c in candidates)
    raise PtqError(f"{path}: does not take a float32 batch of {shapes} ({cause})")


@dataclass(frozen=True)
class Options(BackendOptions, owner="PyTorch", backends="pytorch"):
    """How a model that cannot saturate keeps so (`activation_bits`); its rule on the common types."""

    activation_bits: str | None = option(
        None, choices=ACTIVATION_BITS,
        help="With --overflow-fix all-layers (the default on --cpus all for a model with ReLU6): 8 (every layer's weights under "
             "the pair rule) or 7 (torch.ao's reduce_range); either way fbgemm cannot saturate on a CPU without VNNI. "
             "(default: the one closer to FP32 on held-out calibration images; 7 where the graph's batch is fixed)")

    def without_overflow_fix(self) -> Options:
        return replace(self, activation_bits=None)

    def settle(self, common: CommonChoices) -> tuple[Options, CommonChoices]:
        if "uint8" in (common.dtype, common.weight_dtype):
            option = "--dtype" if common.dtype == "uint8" else "--weight-dtype"
            raise PtqError(
                f"{option} uint8: PyTorch's x86/fbgemm quantized convolutions need signed int8 weights "
                "(their activations are uint8 already); use --dtype int8, or --backend onnxruntime for uint8"
            )
        return self, common


def _describe(settings: dict) -> str:
    # PyTorch's x86 kernels pair unsigned activations with signed weights whatever the model is called.
    return describe_settings(settings, types="a:quint8 w:qint8")


def _proof(settings: dict, int8_path: str) -> str:
    """A model that cannot saturate (all-layers) computes in fbgemm on a CPU with VNNI what it computes without: its
    saturating path is scored here in fbgemm (torch's x86 engine runs most convolutions in oneDNN on a VNNI CPU, which
    rounds some outputs differently); away from VNNI its exact path is fbgemm's own figure."""
    why = "7-bit activations: 2 x 127 x 128 <= 32,767" if seven_bit_activations(settings) else "the pair rule on every layer: 255 x 128 <= 32,767"
    if int8_path == SATURATING:
        return f"proof ({why}): fbgemm's kernels run here, as on a CPU without VNNI"
    return f"proof ({why}): fbgemm's figure; on a CPU with AVX512-VNNI torch runs most convolutions in oneDNN, which rounds some outputs differently"


BACKEND = Backend(
    NAME, (SUFFIX,), sniff, format="FX", suffix_decides=True, summary="torch.ao FX graph mode, x86 engine, saved as TorchScript (deprecated: goes in ptq 0.6)",
    quantizer=Quantizer(
        # PyTorch's x86 default is per-channel; FX quantizes every layer it can.
        quantize, methods=(AUTO_METHOD, "histogram", "minmax", PER_IMAGE), tune_methods=("histogram", "minmax"), per_channel=True,
        leaves_layers_float=False,
        overflow_fixes=(overflow.FIRST_LAYER, overflow.ALL_LAYERS), clamped_overflow_fix=overflow.ALL_LAYERS, judges_overflow_fix=True,
        overflow_words=lambda settings: {overflow.ALL_LAYERS: "7-bit activations"} if seven_bit_activations(settings) else {},
        options=Options, describe=_describe,
    ),
    # fbgemm's kernels differ by CPU, with no switch; its OpenMP threads spin after a run.
    runtime=Runtime(load, settings="torch.set_num_threads(threads), chunks of 64 images", spins_when_idle=True),
    int8_paths=int8_paths.without_exact_switch("a PyTorch model", "fbgemm", overflow.ALL_LAYERS, _proof, proof_loads_saturating_kernels=True),
)
