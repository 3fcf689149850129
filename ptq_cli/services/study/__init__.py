"""Orchestration: the study pipeline (`ptq run`), sweeps, tuning and per-layer sensitivity, made of the other services."""
