"""The project's fixed facts and default locations: the one place for each of them."""

from __future__ import annotations

import os
from pathlib import Path

# Where the real assets live; one setting, overridable for another location.
ASSETS_ENV = "PTQ_ASSETS"
DEFAULT_ASSETS = Path("../shared/assets")


def assets_dir() -> Path:
    return Path(os.environ.get(ASSETS_ENV, str(DEFAULT_ASSETS)))


def cifar_dir() -> Path:
    return assets_dir() / "cifar-10-batches-py"


def keras_model_path() -> Path:
    return assets_dir() / "mlperf-tiny-resnet8" / "pretrainedResnet.h5"


def mlperf_reference_path() -> Path:
    """MLCommons' own full-int8 TFLite ResNet8: the reference the study's 8-bit models are judged against."""
    return assets_dir() / "mlperf-tiny-resnet8" / "pretrainedResnet_quant.tflite"


MLPERF_REFERENCE_LABEL = "MLPerf Tiny reference int8"


# Decoded datasets, keyed by the source files' content (see datasets/base.py).
CACHE_ENV = "PTQ_CACHE_DIR"


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "ptq")


# The CPUs this process may keep busy, where it is given a share of the machine (a Ray worker's task has one):
# the default thread count of everything ptq runs, instead of every core.
TASK_CPUS_ENV = "PTQ_TASK_CPUS"


def task_cpus() -> int | None:
    value = os.environ.get(TASK_CPUS_ENV, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


# Where the pipeline writes, relative to the working directory.
MODELS_DIR = Path("models")
FP32_ONNX = MODELS_DIR / "resnet8.onnx"
CALIBRATION_FILE = Path("calibration/cifar10_calib.npz")
RESULTS_DIR = Path("results")
MARKDOWN_REPORT = Path("reports/QUANTIZATION_ANALYSIS.md")
# `ptq run` describes how every file it made came about in RESULTS_DIR/MANIFEST_NAME (not a record).
MANIFEST_NAME = "manifest.json"

# Calibration defaults (the seed study): 100 images per class = 1000 samples, seed 42.
# Images per inference call when evaluating: shards of 64 per thread keep a small model's activations in
# cache (benchmarks/own_data.py measures the effect).
EVALUATION_BATCH = 128

SAMPLES_PER_CLASS = 100
# Calibration images drawn from a set without labels (or all it has): as many as SAMPLES_PER_CLASS gives CIFAR-10.
CALIBRATION_IMAGES = 1000
SEED = 42

# Validation split for tuning: drawn from the training batches, disjoint from the calibration samples.
# 500 images per class = 5,000: one point of validation accuracy is 50 images.
VALIDATION_PER_CLASS = 500
VALIDATION_SEED = 7
