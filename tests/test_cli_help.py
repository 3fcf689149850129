"""Every command is registered and has its own help (in-process). The app's description names some
commands too, so the listing is checked by the command table's rows, and each command by its own --help."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from synthetic import invoke

COMMANDS = ("fetch", "convert", "calibrate", "quantize", "prune", "sweep", "sensitivity", "tune", "evaluate", "benchmark", "report", "run", "export")


def test_help_lists_every_command_in_its_table():
    result = invoke("--help", cwd=Path.cwd())
    assert result.exit_code == 0
    # A row of the Commands panel: the border, the name, then its summary.
    listed = re.findall(r"^│ (\w+) {2,}\S", result.stdout, flags=re.MULTILINE)
    assert sorted(listed) == sorted(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_has_its_own_help(command):
    result = invoke(command, "--help", cwd=Path.cwd())
    assert result.exit_code == 0, result.output
    assert f"Usage: ptq {command} [OPTIONS]" in " ".join(result.stdout.split())


def test_quantize_help_explains_options():
    result = invoke("quantize", "--help", cwd=Path.cwd())
    for option in ("--dtype", "--weight-dtype", "--per-channel", "--method", "--calibration", "--output", "--data", "--preprocess"):
        assert option in result.stdout
