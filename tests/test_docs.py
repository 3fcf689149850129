"""The documentation as a user meets it: the CLI reference is what the app says (generated, never hand-copied), every
page is in the site's navigation, and the Python API page's example runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml
from synthetic import conv_classifier, image_folder

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def test_the_cli_reference_is_generated_from_the_app_and_current():
    checked = subprocess.run([sys.executable, str(ROOT / "tools" / "cli_reference.py"), "--check"], capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stderr
    page = (DOCS / "cli.md").read_text(encoding="utf-8")
    assert "`--weight-dtype`" in page and "`--help-all`" not in page  # every option, advanced ones too
    import typer.main

    from ptq_cli.cli import app

    assert re.findall(r"^## ptq (\w+)", page, flags=re.MULTILINE) == list(typer.main.get_command(app).commands)


def _nav_pages(items) -> list[str]:
    pages = []
    for item in items:
        for value in item.values() if isinstance(item, dict) else [item]:
            pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_docs_page_is_in_the_site_navigation():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    listed = set(_nav_pages(config["nav"]))
    assert listed == {path.name for path in DOCS.glob("*.md")}


def test_the_python_api_example_runs_as_written(tmp_path, monkeypatch):
    conv_classifier(tmp_path / "model.onnx")
    image_folder(tmp_path / "images", per_class=8)  # images/train|test/<colour>/*.png
    page = (DOCS / "python-api.md").read_text(encoding="utf-8")
    code = "\n".join(re.findall(r"```python\n(.*?)```", page, flags=re.DOTALL))
    monkeypatch.chdir(tmp_path)
    printed: list[str] = []
    exec(compile(code, "python-api.md", "exec"), {"print": lambda *args: printed.append(" ".join(map(str, args)))})  # noqa: S102  the page's own example
    assert printed[0].startswith("model_") and "of the FP32 size" in printed[0]
    assert [line.split(":")[0] for line in printed[1:]] == ["model.onnx", Path(printed[0].split(":")[0]).name]
    assert all("% on 24 images" in line for line in printed[1:])
    assert any((tmp_path / "results").glob("*.json"))


def test_the_preprocessing_page_gives_every_presets_own_values():
    from ptq_cli.inputs import PRESETS

    page = (DOCS / "preprocessing.md").read_text(encoding="utf-8")
    for name, (scale, mean, std) in PRESETS.items():
        row = next(line for line in page.splitlines() if line.startswith(f"| `{name}` |"))
        cells = [cell.strip() for cell in row.split("|")[2:5]]
        assert cells[0] == ("1" if scale == 1 else "1/255")
        assert cells[1:] == [", ".join(f"{value:g}" for value in values) for values in (mean, std)], name
