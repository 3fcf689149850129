"""ptq: post-training quantization of image classifiers, measured on real data."""

__version__ = "0.4.0"
