"""Measurement: evaluation, benchmarks, their records and the report read from them."""
