"""Compatibility with the CPU-only torch this project pins: onnx2torch without torchvision.

onnx2torch imports torchvision at import time, for its NMS and RoiAlign converters only. The registry's
torchvision is a CUDA build that cannot import next to the CPU torch 2.13.0, so the project never
installs it. When no importable torchvision is present, a stand-in module is registered whose three
functions (the only ones onnx2torch uses) raise a clear error if a model ever needs them; ResNet8 and
other plain classifiers use none of them.
"""

from __future__ import annotations

import importlib
import sys
import types

TORCHVISION_FUNCTIONS = ("nms", "box_convert", "roi_align")



def _torchvision_stand_in() -> types.ModuleType:
    def unavailable(*_args: object, **_kwargs: object) -> None:
        raise NotImplementedError("this model needs torchvision's detection operators, which ptq does not install")

    torchvision = types.ModuleType("torchvision")
    ops = types.ModuleType("torchvision.ops")
    for name in TORCHVISION_FUNCTIONS:
        setattr(ops, name, unavailable)
    setattr(torchvision, "ops", ops)  # noqa: B010  a module built here: setattr keeps the type checker out of it
    setattr(torchvision, "__ptq_stand_in__", True)  # noqa: B010
    return torchvision


def import_onnx2torch() -> types.ModuleType:
    if "onnx2torch" in sys.modules:
        return sys.modules["onnx2torch"]
    try:
        importlib.import_module("torchvision.ops")
    except Exception:  # absent, or a CUDA build failing to load its libraries: either way, unusable here
        for name in [key for key in sys.modules if key == "torchvision" or key.startswith("torchvision.")]:
            del sys.modules[name]
        stand_in = _torchvision_stand_in()
        sys.modules["torchvision"] = stand_in
        sys.modules["torchvision.ops"] = stand_in.ops
    return importlib.import_module("onnx2torch")
