"""The `ptq` command line: parse options, call a service, render the result. Nothing else lives here.

app.py holds the application and its error handler, options.py the options the commands share, console.py what is
printed and how progress shows, commands.py the commands (importing it registers them)."""

from ptq_cli.cli import commands  # noqa: F401  registers the commands on the app
from ptq_cli.cli.app import _fill_optional_values, app, main, run_stage_command

__all__ = ["_fill_optional_values", "app", "main", "run_stage_command"]
