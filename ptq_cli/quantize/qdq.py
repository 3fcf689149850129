"""The quantization engine over QDQ graphs: the graph prepared (nodes left in float, the runtime's rewrites), the
recipe judged, written by onnxruntime.quantization and refined; the runtime that runs the model supplies where its
quantizers go and how it finishes the graph (a Placement). onnxruntime's backend and OpenVINO's both start here."""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import numpy as np

from ptq_cli import model_file
from ptq_cli.errors import PtqError
from ptq_cli.guards import bounded
from ptq_cli.guards.atomic import atomic_output
from ptq_cli.model_file import (
    describe_input,
    free_batch,
    metadata,
)
from ptq_cli.quantize import overflow, policy, reuse, rounding
from ptq_cli.quantize.calibration import warning_notes, write_qdq
from ptq_cli.quantize.job import Job
from ptq_cli.quantize.judges import calibrated_model, fix_overrides, judged_choices, refined
from ptq_cli.quantize.placement import ONNXRUNTIME_X86, Placement
from ptq_cli.quantize.settings import (
    AUTO_METHOD,
    PER_IMAGE,
    QuantizationSettings,
    QuantizeCall,
    QuantizedFile,
    progress_after,
)
from ptq_cli.transforms.graph import preprocess, whole_map_average_pools
from ptq_cli.transforms.qdq_edits import float_scores, keep_float_layers
from ptq_cli.transforms.space_to_depth import Rewrite

# The QDQ models the engine writes are onnxruntime.quantization's, stored with onnxruntime's settings: OpenVINO's
# default IR is one of them (its pairs placed for OpenVINO) converted; within `ptq run` a model made from the same
# inputs and placement is written again, not made again (reuse.made_once).
WRITER, FORMAT, SUFFIX = "onnxruntime", "QDQ", ".onnx"
# The activation ranges it calibrates. Entropy is not tuned: quantize_static does not pass a histogram size to it,
# and with its default 128 bins equal to its 128 quantized bins the KL search has a single candidate, the full range.
METHODS = (AUTO_METHOD, "minmax", "entropy", "percentile", PER_IMAGE)


def _named(graph, nodes: list, prefix: str) -> list[str]:
    """The nodes' names, an unnamed one named here (`prefix`_index, unique in the graph) so that quantize_static
    can be told to leave it in float."""
    names = {node.name for node in graph.graph.node}
    for index, node in enumerate(nodes):
        if not node.name:
            node.name = f"{prefix}_{index}"
            while node.name in names:
                node.name += "_"
            names.add(node.name)
    return [node.name for node in nodes]


def stem_nodes(graph) -> list[str]:
    """The names of the stem's weighted nodes (`overflow.first_layers`) and of every node between the input and
    them, to be left in float. A float stem whose input came from a DequantizeLinear would not stay float:
    onnxruntime's optimizer quantizes the weights of a float Conv between a DequantizeLinear and a QuantizeLinear
    when it loads the model."""
    stem, before = overflow.walk_to_stem(graph)
    return _named(graph, [*stem, *before], "ptq_stem")


def output_softmax_nodes(graph) -> list[str]:
    """The Softmax / LogSoftmax nodes that give the graph's outputs, to be left in float, so the probabilities are
    not rounded to multiples of 1/255 (nothing runs after them to gain from int8)."""
    outputs = {value.name for value in graph.graph.output}
    found = [node for node in graph.graph.node if node.op_type in ("Softmax", "LogSoftmax") and outputs.intersection(node.output)]
    return _named(graph, found, "ptq_output_softmax")


def pooled_feature_nodes(graph) -> list[str]:
    """The average pools over a whole map (`whole_map_average_pools`), to be left in float: the layer that reads the
    pooled features then quantizes them on their own calibrated range, as after a GlobalAveragePool (which
    quantize_static leaves float), not on the scale of the map they average."""
    return _named(graph, whole_map_average_pools(graph), "ptq_pooled_features")


@dataclass(frozen=True)
class _Prepared:
    """What quantize_static takes, after onnxruntime's pre-processing and ptq's rewrites."""

    source: str  # the rewritten graph's path
    rewrites: list[Rewrite]  # space-to-depth
    overrides: dict | None  # the weight scales of the overflow fix
    float_nodes: list[str]  # the nodes left in float
    pools: list[str]  # of those, the average pools over a whole map
    writer_options: tuple[tuple[str, object], ...] = ()  # the runtime's say in where pairs go (Placement.writer_options)


def _graph_to_quantize(model, settings: QuantizationSettings, workdir: Path, placement: Placement) -> _Prepared:
    """onnxruntime's pre-processing, then the runtime's rewrites (its placement), saved in `workdir` for quantize_static."""
    import onnx

    source = model
    if settings.preprocess:
        source = str(workdir / "preprocessed.onnx")
        preprocess(model, source)
    graph = onnx.load(source) if isinstance(source, str) else onnx.ModelProto.FromString(model.SerializeToString())
    float_nodes = list(settings.float_nodes)
    float_nodes += [name for name in output_softmax_nodes(graph) if name not in float_nodes]
    pools = [name for name in pooled_feature_nodes(graph) if name not in float_nodes]
    float_nodes += pools
    if settings.stem == "float":
        float_nodes += [name for name in stem_nodes(graph) if name not in float_nodes]
    missing = sorted(set(float_nodes) - {node.name for node in graph.graph.node})
    if missing:
        raise PtqError(f"{model.graph.name or 'model'}: no node named '{missing[0]}' to leave in float")
    graph, rewrites = placement.rewrite(graph, settings, float_nodes)
    source = str(workdir / "to_quantize.onnx")
    onnx.save(graph, source)
    return _Prepared(source, rewrites, fix_overrides(graph, settings, float_nodes), float_nodes, pools, placement.writer_options(graph))


LEARNED, NEAREST = rounding.LEARNED, rounding.NEAREST


def _stored_props(settings: QuantizationSettings, rewrites, stored: dict[str, str], source) -> dict[str, str]:
    """The quantized model's metadata: its settings and rewrites, what the caller keeps in it, and the source's pruning."""
    described_settings = {**settings.as_dict(), "space_to_depth_convs": [asdict(rewrite) for rewrite in rewrites]}
    extra = bounded.json_loads(stored.pop(model_file.QUANTIZATION_METADATA_KEY, "{}"))
    props = {model_file.QUANTIZATION_METADATA_KEY: json.dumps({**described_settings, **extra}), **stored}
    props.update({key: value for key, value in metadata(source).items() if key == model_file.PRUNING_METADATA_KEY})  # a pruned source stays described
    return props


def quantize(call: QuantizeCall, placement: Placement = ONNXRUNTIME_X86) -> QuantizedFile:
    """onnxruntime.quantization.quantize_static in QDQ format, written atomically.

    `call.calibration` is the calibration images in the model's input format; `call.stored` is metadata to keep
    in the model (settings, input contract, source sha256, tune's validation scores). Within `ptq run`, a
    model already made from the same inputs is written again rather than made again (reuse.made_once). `placement`:
    where the runtime the model is for wants its pairs (placement.py)."""
    model, settings, calibration, stored = call.model, call.settings, call.calibration, call.stored
    if call.deadline is not None:  # what a time budget leaves out depends on the clock: made here, never handed back
        return quantize_qdq(call, placement)
    return reuse.made_once(lambda: reuse.digest(model.SerializeToString(), repr((calibration.shape, str(calibration.dtype))).encode(),
                                              np.ascontiguousarray(calibration).tobytes(), repr(settings).encode(), repr(sorted(stored.items())).encode(),
                                              type(placement).__name__.encode()),
                          Path(call.output), lambda: quantize_qdq(call, placement))


def quantize_qdq(call: QuantizeCall, placement: Placement = ONNXRUNTIME_X86) -> QuantizedFile:
    """The engine's steps on one model: the graph prepared, the recipe judged (judges.judged_choices), the QDQ model
    written and finished, then refined (judges.refined); the bar goes on past the calibration images, one step per
    refined layer, then per run of the range search."""
    import onnx

    model, output, settings, calibration, progress = call.model, call.output, call.settings, call.calibration, call.progress
    described, _ = describe_input(Path(model.graph.name or "model"), model)
    notes: list[str] = []
    fixed_batch = described.batch
    freed = free_batch(Path(model.graph.name or "model"), model, described) if described.batch is not None else None
    if freed is not None:
        model, fixed_batch = freed, None
        notes.append(f"fixed batch {described.batch} made symbolic in the quantized model (same outputs)")

    with tempfile.TemporaryDirectory(prefix="ptq-quantize-") as workdir:
        prepared = _graph_to_quantize(model, settings, Path(workdir), placement)
        notes += policy.pools_in_float_note(prepared.pools, "onnxruntime")
        job = Job(prepared.source, calibration, described.name, prepared.float_nodes,
                  partial(_finish, rewrites=prepared.rewrites, float_nodes=prepared.float_nodes, placement=placement), Path(workdir), output,
                  model.graph.name or "model", fixed_batch, prepared.writer_options, call.saturating_scores, call.deadline)
        search = settings.method == AUTO_METHOD
        settings, overrides, chosen, done = judged_choices(job, settings, prepared.overrides, progress)
        notes += chosen
        with atomic_output(output) as tmp:
            warnings = write_qdq(job, tmp, calibration, settings, overrides, progress_after(progress, done), fixed_batch=fixed_batch)
            quantized = onnx.load(str(tmp))
            if job.finish(quantized):
                notes.append("output scores: left in float after the last weighted layer (computed from 8-bit inputs and weights, not rounded again)")
            minmax_model = partial(calibrated_model, job, calibration, overrides=overrides) if search and settings.percentile is not None else None
            quantized, settings, refined_notes = refined(job, quantized, settings, search, progress_after(progress, done + len(calibration)), minmax_model)
            notes += refined_notes + placement.finished(quantized)
            onnx.helper.set_model_props(quantized, _stored_props(settings, prepared.rewrites, call.stored, model))
            onnx.save(quantized, str(tmp))
            return QuantizedFile(tmp.stat().st_size, tuple(prepared.rewrites), tuple(notes + warning_notes(warnings)), settings)


def _finish(quantized, rewrites: list, float_nodes, placement: Placement) -> int:
    """ptq's edits to what quantize_static wrote (the runtime's first); how many roundings of the output scores were removed."""
    placement.after_write(quantized, rewrites)
    keep_float_layers(quantized, float_nodes)
    return float_scores(quantized)


