"""Measurement: evaluation, benchmarks, what running on every x86 CPU costs (portability), and the report read from their records."""
