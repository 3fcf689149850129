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


def test_quantize_help_fits_a_screen_and_help_all_shows_every_option():
    """--help: the options a first run needs, a sentence each, in at most 120 lines at 80 columns; --help-all: every
    option with its whole text (each backend's panel too), and the short form comes back after it."""
    short = invoke("quantize", "--help", cwd=Path.cwd(), columns=80)
    assert short.exit_code == 0, short.output
    assert len(short.stdout.splitlines()) <= 120
    for option in ("--model", "--backend", "--dtype", "--per-channel", "--method", "--cpus", "--output", "--data", "--preprocess", "--mean", "--json"):
        assert option in short.stdout
    assert "--weight-dtype" not in short.stdout and "--help-all" in short.stdout
    every = invoke("quantize", "--help-all", cwd=Path.cwd(), columns=80)
    assert every.exit_code == 0, every.output
    for option in ("--weight-dtype", "--calibration", "--overflow-fix", "--rounding", "--percentile", "NNCF (--backend openvino)", "LiteRT (--backend litert)"):
        assert option in every.stdout
    assert len(every.stdout.splitlines()) > 2 * len(short.stdout.splitlines())
    assert invoke("quantize", "--help", cwd=Path.cwd(), columns=80).stdout == short.stdout


def test_shell_completion_is_offered():
    shown = invoke("--help", cwd=Path.cwd()).stdout
    assert "--install-completion" in shown and "--show-completion" in shown
