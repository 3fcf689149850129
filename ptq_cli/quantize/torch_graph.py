"""ONNX models as torch modules (onnx2torch), for the engines over PyTorch's quantization (torch.ao FX, torchao PT2E):
the conversion, a fixed batch made symbolic where that computes the same, and the graph made exportable."""

from __future__ import annotations

import tempfile
from pathlib import Path

from ptq_cli.errors import PtqError, first_line
from ptq_cli.model_file import describe_input, free_batch
from ptq_cli.transforms.graph import generated_node_names, preprocess, static_reshape_targets
from ptq_cli.transforms.torch_compat import import_onnx2torch


def onnx_to_graph_module(model, fold: bool = True):
    """The ONNX model as a torch.fx GraphModule (onnx2torch).

    With `fold`, onnxruntime's own graph optimizer (quant_pre_process) first folds the batch-norm
    Mul/Add that tf2onnx leaves after each Conv, so the torch graph is plain Conv/ReLU/add/Linear that
    FX quantization fuses and quantizes end to end.
    """
    import onnx

    onnx2torch = import_onnx2torch()
    named = model.graph.name or "model"  # the file, as the services name it
    if fold:
        with tempfile.TemporaryDirectory(prefix="ptq-torch-") as workdir:
            folded = Path(workdir) / "folded.onnx"
            preprocess(model, folded)
            model = onnx.load(str(folded))
    try:
        return onnx2torch.convert(generated_node_names(static_reshape_targets(model))).eval()
    except Exception as error:  # onnx2torch raises NotImplementedError and others for ops it lacks
        raise PtqError(f"{named}: onnx2torch cannot convert it ({type(error).__name__}: {first_line(error, '')})") from error


def torch_ready(model, path: Path, size: tuple[int, int] | None = None):
    """(model, ModelInput, fixed batch or None): a fixed batch is made symbolic where that computes the same; `size`
    gives the height and width a model leaves open (--input-size)."""
    described, _ = describe_input(path, model, size)
    if described.batch is None:
        return model, described, None
    freed = free_batch(path, model, described)
    return (freed, described, None) if freed is not None else (model, described, described.batch)
