"""Making files: calibration sets, converted and pruned models, quantized models, their C export."""
