"""Orchestration: the study pipeline (`ptq run`), sweeps and tuning, made of the other services."""
