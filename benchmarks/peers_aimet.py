"""AIMET-ONNX's quantization of an ONNX model, exported to QDQ for onnxruntime: run by benchmarks/peers.py in the
peers' own virtual environment (.venv-peers, `make peers`), never in ptq's.

    .venv-peers/bin/python benchmarks/peers_aimet.py MODEL.onnx CALIBRATION_INPUTS.npy OUTPUT.onnx [--adaround] [--iterations N] [--first-layers N]

QuantSim with AIMET's per-channel configuration (8-bit weights and activations, min-max), encodings computed on the
calibration inputs (already in the model's input format); with --adaround, AdaRound learns every weight's rounding
first (AIMET recommends 10,000 iterations a layer; the default here is fewer, to finish on 2 CPU cores).
onnx2torch, which AIMET imports, imports torchvision; the peers' environment has none (its registry build needs a
CUDA torch), so ptq's own stand-in (`ptq_cli/transforms/torch_compat.py`, standard library only) is registered first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("calibration", type=Path)
    parser.add_argument("output", type=Path)
    parser.add_argument("--adaround", action="store_true")
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--first-layers", type=int, default=None,
                        help="AdaRound only the first N Conv/Gemm/MatMul layers: AIMET samples every image through both models for each layer it rounds")
    options = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from ptq_cli.transforms.torch_compat import import_onnx2torch

    import_onnx2torch()
    import aimet_onnx
    from aimet_onnx import QuantizationSimModel, apply_adaround

    config = Path(aimet_onnx.__file__).parent / "common" / "quantsim_config" / "default_config_per_channel.json"
    model = onnx.load(str(options.model))
    name = model.graph.input[0].name
    calibration = np.load(options.calibration, allow_pickle=False).astype(np.float32)
    batches = [{name: calibration[start : start + 16]} for start in range(0, len(calibration), 16)]
    sim = QuantizationSimModel(model, param_type=aimet_onnx.int8, activation_type=aimet_onnx.int8, quant_scheme="min_max",
                               config_file=str(config), providers=["CPUExecutionProvider"])
    if options.adaround:
        weighted = [node.name for node in model.graph.node if node.op_type in ("Conv", "Gemm", "MatMul")]
        chosen = weighted[: options.first_layers] if options.first_layers else None
        apply_adaround(sim, batches, num_iterations=options.iterations, nodes_to_include=chosen)
    sim.compute_encodings(batches)
    onnx.save(sim.to_onnx_qdq(), str(options.output))


if __name__ == "__main__":
    main()
