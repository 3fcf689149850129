"""TensorFlow SavedModel folders for `ptq convert --keras`, vetted before TensorFlow loads them.

A SavedModel is a graph, and a graph may hold ops that read or write files, run Python or reach the network; loading it
runs its initialisers, calling it runs its signature. So ptq reads `saved_model.pb` itself first (parsing a protobuf runs
nothing) and lets TensorFlow load the folder only when every op of every function and of the graph is one an image
classifier computes with (OPS). The save and restore functions TensorFlow writes for checkpoints touch files by design;
TensorFlow's loader restores variables through its own code and never calls them, so they are left out of the check
as long as nothing but the saver's own nodes names them. docs/security.md: "SavedModel folders".
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ptq_cli.errors import PtqError, first_line
from ptq_cli.guards import bounded

GRAPH_FILE = "saved_model.pb"
SERVING_TAG, SERVING_SIGNATURE = "serve", "serving_default"

# What the graphs of image classifiers (Keras, tf.Module, TF-Hub style) compute with: arithmetic, neural network
# layers, shapes, resource variables and calls of the file's own functions. None of them reaches a file, a process or
# the network; anything else is refused by name.
OPS = frozenset({
    # graph plumbing, calls and control flow (their functions are vetted too)
    "Const", "Identity", "IdentityN", "NoOp", "Placeholder", "PlaceholderWithDefault", "StopGradient", "PreventGradient",
    "PartitionedCall", "StatefulPartitionedCall", "If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase",
    "VarHandleOp", "ReadVariableOp", "AssignVariableOp", "VarIsInitializedOp", "DisableCopyOnRead", "DestroyResourceOp",
    "Assert", "CheckNumerics", "EnsureShape",
    # arithmetic
    "Add", "AddV2", "AddN", "Sub", "Mul", "MulNoNan", "Div", "DivNoNan", "RealDiv", "FloorDiv", "FloorMod", "Mod", "Neg",
    "Abs", "Sign", "Square", "SquaredDifference", "Sqrt", "Rsqrt", "Reciprocal", "Inv", "Exp", "Log", "Log1p", "Pow",
    "Maximum", "Minimum", "Floor", "Ceil", "Round", "Rint", "Erf", "Tanh", "Sigmoid", "Cos", "Sin", "ClipByValue",
    "Equal", "NotEqual", "Less", "LessEqual", "Greater", "GreaterEqual", "LogicalAnd", "LogicalOr", "LogicalNot",
    "Select", "SelectV2", "Cast", "IsNan", "IsFinite",
    # reductions and matrix products
    "Sum", "Mean", "Max", "Min", "Prod", "ArgMax", "ArgMin", "All", "Any", "MatMul", "BatchMatMul", "BatchMatMulV2",
    "BatchMatMulV3", "Einsum",
    # neural network layers
    "Conv2D", "Conv3D", "DepthwiseConv2dNative", "Conv2DBackpropInput", "BiasAdd", "Relu", "Relu6", "Elu", "Selu", "LeakyRelu",
    "Softplus", "Softsign", "Softmax", "LogSoftmax", "MaxPool", "MaxPoolV2", "AvgPool", "MaxPool3D", "AvgPool3D",
    "FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3", "LRN", "L2Loss", "ResizeBilinear", "ResizeNearestNeighbor",
    "ResizeBicubic", "ResizeArea", "TopKV2", "MirrorPad", "Pad", "PadV2", "DepthToSpace", "SpaceToDepth",
    "SpaceToBatchND", "BatchToSpaceND",
    # shapes
    "Shape", "ShapeN", "Size", "Rank", "Reshape", "Squeeze", "ExpandDims", "Transpose", "ConcatV2", "Concat", "Pack",
    "Unpack", "Split", "SplitV", "Slice", "StridedSlice", "Tile", "Fill", "ZerosLike", "OnesLike", "Range", "GatherV2",
    "Gather", "GatherNd", "BroadcastTo", "BroadcastArgs", "Reverse", "ReverseV2", "OneHot", "Cumsum", "Where",
})

# The checkpoint functions TensorFlow writes into every SavedModel (save: SaveV2, restore: RestoreV2), called by the
# saver's nodes; what they hold besides OPS. TensorFlow's loader restores variables with its own code, never these.
CALLS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})
CHECKPOINT_OPS = frozenset({"SaveV2", "RestoreV2", "MergeV2Checkpoints", "ShardedFilename", "StringJoin", "StaticRegexFullMatch"})


@dataclass(frozen=True)
class Signature:
    """The one input and the one output of a SavedModel's serving signature."""

    input_key: str
    input_shape: tuple[int | None, ...]  # N, H, W, C
    output_key: str


def is_saved_model(path: Path) -> bool:
    return Path(path).is_dir() and (Path(path) / GRAPH_FILE).is_file()


def vet(folder: Path) -> Signature:
    """The folder's serving signature, once its files and every op its graph holds are ones ptq lets TensorFlow run;
    a one-line PtqError otherwise."""
    folder = Path(folder)
    _check_files(folder)
    graph = _read_graph(folder)
    _check_ops(folder, graph)
    return _signature(folder, graph)


def digest(folder: Path) -> str:
    """sha256 of the folder: each file's path inside it and its bytes, in path order."""
    total = hashlib.sha256()
    for path in sorted(_files(Path(folder))):
        total.update(path.relative_to(folder).as_posix().encode() + b"\0")
        total.update(bounded.sha256(path, bounded.MODEL_BYTES, "SavedModel file"))
    return total.hexdigest()


@dataclass(frozen=True)
class SavedModel:
    """A vetted SavedModel's serving signature, callable as Keras models are in conversion."""

    path: Path
    signature: Signature
    function: Any  # the loaded signature (a TensorFlow concrete function)
    root: Any  # the loaded object: its variables live as long as it does

    @property
    def input_shape(self) -> tuple[int | None, ...]:
        return self.signature.input_shape

    def predict(self, images: np.ndarray, batch_size: int = 500) -> np.ndarray:
        import tensorflow as tf

        parts = [self.function(**{self.signature.input_key: tf.constant(images[start : start + batch_size])})[self.signature.output_key].numpy()
                 for start in range(0, len(images), batch_size)]
        return np.concatenate(parts).reshape(len(images), -1)

    def to_onnx(self, opset: int) -> Any:
        """The signature, its variables frozen to constants, as an ONNX ModelProto whose input is named "input"."""
        import tensorflow as tf
        import tf2onnx
        from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2

        frozen = convert_variables_to_constants_v2(self.function)
        names = [tensor.name for tensor in frozen.inputs if tensor.dtype != tf.resource]
        model_proto, _ = tf2onnx.convert.from_graph_def(frozen.graph.as_graph_def(), input_names=names,
                                                        output_names=[tensor.name for tensor in frozen.outputs], opset=opset)
        (first,) = [value for value in model_proto.graph.input if value.name == names[0]]
        for node in model_proto.graph.node:
            node.input[:] = ["input" if name == first.name else name for name in node.input]
        first.name = "input"
        return model_proto


def load(folder: Path) -> SavedModel:
    """The folder vetted (`vet`), then loaded by TensorFlow; one line if TensorFlow cannot."""
    import tensorflow as tf

    signature = vet(folder)
    try:
        loaded = tf.saved_model.load(str(folder), tags=[SERVING_TAG])
        function = loaded.signatures[SERVING_SIGNATURE]
    except Exception as error:  # TensorFlow raises many types for a folder it cannot load; all mean the same here
        raise PtqError(f"{folder}: TensorFlow cannot load this SavedModel ({first_line(error)})") from error
    return SavedModel(Path(folder), signature, function, loaded)


def _files(folder: Path) -> Iterator[Path]:
    for root, directories, names in os.walk(folder, followlinks=False):
        for name in directories:
            if Path(root, name).is_symlink():
                raise PtqError(f"{folder}: a SavedModel folder holding a link ({Path(root, name)}); refused")
        yield from (Path(root, name) for name in names)


def _check_files(folder: Path) -> None:
    """Regular files only (no link out of the folder, nothing that blocks when read), within the model bound."""
    total = 0
    for path in _files(folder):
        if path.is_symlink():
            raise PtqError(f"{folder}: a SavedModel folder holding a link ({path}); refused")
        total += bounded.regular_size(path, "SavedModel file")
    if total > bounded.MODEL_BYTES.value():
        raise bounded.MODEL_BYTES.refuse(folder, f"{total:,} bytes in the SavedModel folder")


def _read_graph(folder: Path) -> Any:
    from google.protobuf.message import DecodeError
    from tensorflow.core.protobuf import saved_model_pb2

    saved = saved_model_pb2.SavedModel()
    try:
        saved.ParseFromString(bounded.read_bytes(folder / GRAPH_FILE, bounded.MODEL_BYTES, "SavedModel graph"))
    except (DecodeError, RuntimeError) as error:
        raise PtqError(f"{folder / GRAPH_FILE}: not a SavedModel graph ({first_line(error)})") from error
    serving = [graph for graph in saved.meta_graphs if SERVING_TAG in graph.meta_info_def.tags]
    if len(serving) != 1:
        raise PtqError(f"{folder}: a SavedModel with {len(serving)} graphs tagged '{SERVING_TAG}'; ptq converts one")
    if not serving[0].HasField("object_graph_def"):
        raise PtqError(f"{folder}: a TensorFlow 1 SavedModel (no object graph); save it again with TensorFlow 2 or as .keras")
    return serving[0]


def _called(node: Any) -> set[str]:
    """The functions a node names in its attributes (a call's `f`, a control flow op's branches and bodies)."""
    names = set()
    for value in node.attr.values():
        if value.HasField("func"):
            names.add(value.func.name)
        names.update(function.name for function in value.list.func)
    return names


def _check_ops(folder: Path, graph: Any) -> None:
    saver_nodes = {graph.saver_def.save_tensor_name.split(":")[0], graph.saver_def.restore_op_name.split(":")[0]} - {""}
    savers = [node for node in graph.graph_def.node if node.name in saver_nodes]
    checkpoint_functions = {name for node in savers for name in _called(node)}
    checkpoint_nodes = [node for function in graph.graph_def.library.function if function.signature.name in checkpoint_functions
                        for node in function.node_def]
    # The saver's own nodes only call its functions, and those only read and write checkpoints: a saver_def that names
    # any other node, or a checkpoint function that does more, is not what TensorFlow writes.
    odd = sorted({node.op for node in savers} - CALLS) + sorted({node.op for node in checkpoint_nodes} - OPS - CHECKPOINT_OPS)
    nodes = [node for node in graph.graph_def.node if node.name not in saver_nodes]
    nodes += [node for function in graph.graph_def.library.function if function.signature.name not in checkpoint_functions
              for node in function.node_def]
    named = set().union(*(_called(node) for node in nodes)) if nodes else set()
    if named & checkpoint_functions:
        raise PtqError(f"{folder}: a SavedModel whose graph calls its checkpoint functions ({', '.join(sorted(named & checkpoint_functions))}); refused")
    foreign = sorted(set(odd) | ({node.op for node in nodes} - OPS))
    if foreign:
        raise PtqError(f"{folder}: a SavedModel using TensorFlow ops ptq does not run from a SavedModel ({', '.join(foreign[:8])}"
                       f"{', ...' if len(foreign) > 8 else ''}); save the model as .keras and convert that")


def _signature(folder: Path, graph: Any) -> Signature:
    signature = graph.signature_def.get(SERVING_SIGNATURE)
    if signature is None:
        raise PtqError(f"{folder}: a SavedModel without a '{SERVING_SIGNATURE}' signature")
    if len(signature.inputs) != 1 or len(signature.outputs) != 1:
        raise PtqError(f"{folder}: the '{SERVING_SIGNATURE}' signature has {len(signature.inputs)} inputs and "
                       f"{len(signature.outputs)} outputs; ptq converts a classifier of one image input and one output")
    (input_key, tensor), (output_key, _) = next(iter(signature.inputs.items())), next(iter(signature.outputs.items()))
    shape = tuple(None if dim.size < 0 else int(dim.size) for dim in tensor.tensor_shape.dim)
    return Signature(input_key, shape, output_key)
