"""What `ptq quantize` imports: onnxruntime's shape inference without torch, which its tools package imports for a
helper ptq never calls."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from synthetic import conv_classifier

PROBE = """
import sys
import onnx
from ptq_cli.transforms.graph import preprocess
preprocess(onnx.load(sys.argv[1]), sys.argv[2])
print("torch" in sys.modules)
import onnxruntime.tools
import onnxruntime.tools.pytorch_export_helpers as helpers
print(hasattr(helpers, "_parse_inputs_for_onnx_export"), callable(onnxruntime.tools.infer_input_info))
"""


def test_onnxruntime_s_preprocessing_imports_no_torch_and_its_helper_is_still_the_real_one(tmp_path: Path):
    conv_classifier(tmp_path / "m.onnx")
    done = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "m.onnx"), str(tmp_path / "p.onnx")], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "True", "True"], done.stdout + done.stderr
    assert (tmp_path / "p.onnx").is_file()
