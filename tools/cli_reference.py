"""Writes docs/cli.md, the CLI reference, from the Typer app itself: every command, its description and every option
with its whole help text (what `ptq COMMAND --help-all` shows). `make docs` runs it; a test fails when the page is
stale, so the reference is never edited by hand.

    python tools/cli_reference.py            # writes docs/cli.md
    python tools/cli_reference.py --check    # exit 1 if docs/cli.md is not what the app says
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any

PAGE = Path(__file__).resolve().parent.parent / "docs" / "cli.md"

HEADER = """# CLI reference

Generated from ptq's command-line app by `tools/cli_reference.py` (`make docs`); `ptq COMMAND --help` shows the common
options of a command, `ptq COMMAND --help-all` all of these.

"""


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _names(param: Any, ctx: Any) -> str:
    names = ", ".join(f"`{name}`" for name in (*param.opts, *param.secondary_opts))
    shown = param.display_type_rich(ctx) if not getattr(param, "is_flag", False) else None
    return names + (f" {_cell(shown)}" if shown and shown != "<bool>" else "")


def _default(param: Any) -> str:
    if not getattr(param, "show_default", False) or param.default in (None, False, (), []):
        return ""
    value = getattr(param.default, "value", param.default)
    return f" (default: `{value}`)"


def _command(name: str, command: Any, ctx: Any) -> str:
    lines = [f"## ptq {name}", "", inspect.cleandoc(command.help or ""), ""]
    with ctx.scope():
        rows = [(_names(param, ctx), _cell(getattr(param, "help", "") or "") + _default(param))
                for param in command.get_params(ctx) if getattr(param, "opts", None) and not getattr(param, "hidden", False)]
    lines += ["| option | what it does |", "|---|---|", *[f"| {names} | {text} |" for names, text in rows], ""]
    return "\n".join(lines)


def render() -> str:
    import typer.main

    from ptq_cli.cli import app

    group = typer.main.get_command(app)
    with group.make_context("ptq", ["--help"], resilient_parsing=True) as root:
        sections = []
        for name in group.list_commands(root):
            command = group.get_command(root, name)
            sections.append(_command(name, command, command.make_context(name, [], parent=root, resilient_parsing=True)))
    return HEADER + "\n".join(sections)


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not PAGE.is_file() or PAGE.read_text(encoding="utf-8") != text:
            print(f"{PAGE}: stale; run `python tools/cli_reference.py`", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text, encoding="utf-8")
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
