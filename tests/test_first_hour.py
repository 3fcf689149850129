"""A new user's first commands on their own model and a folder of photos without labels (issue 35): the FP32
model evaluates, and benchmark needs no images. In-process, synthetic model and photos."""

from __future__ import annotations

import json
import re

import pytest
from synthetic import channel_mean_classifier, image_folder, invoke, photo_folder

from ptq_cli import settings


@pytest.fixture
def newcomer(tmp_path, monkeypatch):
    """A model and unlabelled photos, and no study assets where ptq looks by default."""
    monkeypatch.setenv(settings.ASSETS_ENV, str(tmp_path / "no-assets"))
    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path / "cache"))
    channel_mean_classifier(tmp_path / "yours.onnx", size=32, classes=19)
    photo_folder(tmp_path / "my_images", count=12, size=48)
    return tmp_path


def test_the_fp32_model_evaluates_on_photos_without_labels_as_the_reference(newcomer):
    result = invoke("evaluate", "--model", "yours.onnx", "--data", "my_images", "--results-dir", "res", "--json", cwd=newcomer)
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert (record["dtype"], record["images"], record["accuracy"], record["fidelity"]) == ("fp32", 12, None, None)
    assert "FP32 reference" in invoke("evaluate", "--model", "yours.onnx", "--data", "my_images", "--results-dir", "res", cwd=newcomer).stdout
    report = invoke("report", "--results-dir", "res", "--json", cwd=newcomer)  # its record reads back
    assert report.exit_code == 0, report.output
    assert [row["model"] for row in json.loads(report.stdout)["groups"][0]["rows"]] == ["yours.onnx"]


def test_a_quantized_model_without_labels_or_source_is_still_refused_in_one_line(newcomer):
    """The quantized model's own source is found from its metadata; with the source gone there is nothing to measure against."""
    photo_folder(newcomer / "other_photos", count=12, size=48, seed=5)
    made = invoke("quantize", "--model", "yours.onnx", "--data", "my_images", "--calibration-data", "other_photos", "--output", "q.onnx", cwd=newcomer)
    assert made.exit_code == 0, made.output
    assert invoke("evaluate", "--model", "q.onnx", "--data", "my_images", "--results-dir", "res", cwd=newcomer).exit_code == 0
    (newcomer / "yours.onnx").unlink()
    result = invoke("evaluate", "--model", "q.onnx", "--data", "my_images", "--results-dir", "res", cwd=newcomer)
    assert result.exit_code == 2 and "--against-fp32" in result.output


def test_benchmark_without_data_feeds_synthetic_pixels_and_says_so(newcomer):
    from ptq_cli.services.measure.benchmark import SYNTHETIC_INPUTS

    result = invoke("benchmark", "--model", "yours.onnx", "--runs", "3", "--results-dir", "res", "--json", cwd=newcomer)
    assert result.exit_code == 0, result.output
    (record,) = json.loads(result.stdout)
    assert record["inputs"] == SYNTHETIC_INPUTS and record["images_per_second"] > 0
    assert "synthetic pixels" in invoke("benchmark", "--model", "yours.onnx", "--runs", "3", "--results-dir", "res", cwd=newcomer).stdout
    too_many = invoke("benchmark", "--model", "yours.onnx", "--batch-size", str(10**9), "--results-dir", "res", cwd=newcomer)
    assert too_many.exit_code == 2 and "PTQ_MAX_CALL_ELEMENTS" in too_many.output  # a batch past the call limit: one line, no allocation
    given = json.loads(invoke("benchmark", "--model", "yours.onnx", "--data", "my_images", "--runs", "3", "--results-dir", "res", "--json",
                              cwd=newcomer).stdout)
    assert "my_images" in given[0]["inputs"] and given[0]["inputs"] != SYNTHETIC_INPUTS


def test_a_quantized_model_ptq_did_not_make_is_described_from_its_graph(newcomer):
    """Plain onnxruntime quantize_static (QDQ, uint8 activations, int8 per-channel weights): the report reads that
    off the graph, never "float"."""
    import numpy as np
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter([{"image": np.random.default_rng(seed).random((1, 3, 32, 32), dtype=np.float32) * 255} for seed in range(4)])

        def get_next(self):
            return next(self.batches, None)

    quantize_static(str(newcomer / "yours.onnx"), str(newcomer / "theirs.onnx"), Reader(), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, per_channel=True)
    result = invoke("evaluate", "--model", "theirs.onnx", "--data", "my_images", "--against-fp32", "yours.onnx", "--results-dir", "res", "--json",
                    cwd=newcomer)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["quantization"]["made_by"] == "another tool"
    rows = {row["model"]: row for row in json.loads(invoke("report", "--results-dir", "res", "--json", cwd=newcomer).stdout)["groups"][0]["rows"]}
    assert rows["theirs.onnx"]["configuration"] == "QDQ a:uint8 w:int8, per-channel (made by another tool)"


def readme_examples() -> list[list[str]]:
    """The commands of the README's "Your own model and images" block, as a user would type them (comments dropped)."""
    import shlex
    from pathlib import Path

    text = (Path(__file__).parent.parent / "README.md").read_text()
    block = text.split("## Your own model and images", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [shlex.split(line.split("#", 1)[0]) for line in block.splitlines() if line.strip()]
    assert commands and all(command[0] == "ptq" for command in commands)
    return [command[1:] for command in commands]


STAGE_LINE = re.compile(r"^\[(\d+)/(\d+)\] (.+) \.\.\.(?: (\d+\.\d) s| (up to date))?$")


def piped_stages(stderr: str) -> list[tuple[int, int, str, bool]]:
    """The stage lines `ptq run` printed to a pipe, checked line by line: each stage starts, then ends, in order; after
    them, and only there, the libraries' warnings, each once (`warning: <text> (<category>, <package>)`)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    warned = [line for line in lines if line.startswith("warning: ")]
    assert lines[len(lines) - len(warned):] == warned and len(set(warned)) == len(warned), lines
    assert not [line for line in warned if not re.fullmatch(r"warning: .+ \(\w*Warning, [\w. -]+\)", line)], warned
    lines = lines[:len(lines) - len(warned)]
    parsed = [STAGE_LINE.match(line) for line in lines]
    assert all(parsed), [line for line, match in zip(lines, parsed, strict=True) if not match]  # nothing else: no library chatter
    stages = []
    for start, end in zip(parsed[::2], parsed[1::2], strict=True):
        assert start.group(1, 2, 3) == end.group(1, 2, 3) and start.group(4) is None and start.group(5) is None
        assert end.group(4) is not None or end.group(5) is not None
        stages.append((int(end.group(1)), int(end.group(2)), end.group(3), end.group(5) is None))
    assert [index for index, _, _, _ in stages] == list(range(1, stages[0][1] + 1)) and len(lines) == 2 * stages[0][1]
    return stages


@pytest.mark.parametrize("kind", ["unlabelled photos", "labelled folder without a train split", "labelled folder with splits"])
def test_every_readme_example_works_on_the_users_own_images(tmp_path, monkeypatch, kind):
    """Each command of the README's section, as written, on a folder of photos without labels and on labelled folders;
    `ptq run`'s progress read from a pipe: one line as each stage starts and one as it ends."""
    monkeypatch.setenv(settings.ASSETS_ENV, str(tmp_path / "no-assets"))
    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path / "cache"))
    if kind == "unlabelled photos":
        channel_mean_classifier(tmp_path / "yours.onnx", size=32, classes=19)
        photo_folder(tmp_path / "my_images", count=16, size=48)
    else:
        channel_mean_classifier(tmp_path / "yours.onnx", size=8, classes=3)
        image_folder(tmp_path / "my_images", splits=("train", "test") if kind.endswith("with splits") else ("test",))
        if kind.endswith("without a train split"):  # ROOT/<class>/*: one labelled set
            for folder in (tmp_path / "my_images" / "test").iterdir():
                folder.rename(tmp_path / "my_images" / folder.name)
            (tmp_path / "my_images" / "test").rmdir()
    for command in readme_examples():
        result = invoke(*command, cwd=tmp_path)
        assert result.exit_code == 0, (command, result.output)
        if command[0] == "quantize":
            said = " ".join(result.stdout.split())
            assert ("the set it is judged on" in said) == (kind != "labelled folder with splits"), said
        if command[0] == "run":
            stages = piped_stages(result.stderr)
            assert all(ran for _, _, _, ran in stages) and stages[-1][2] == "report"
    again = invoke(*readme_examples()[-1], cwd=tmp_path)  # the study again: every stage up to date, said line by line
    assert not any(ran for _, _, _, ran in piped_stages(again.stderr))


def test_tuning_never_validates_on_the_images_models_are_judged_on(newcomer):
    result = invoke("tune", "--model", "yours.onnx", "--data", "my_images", cwd=newcomer)
    assert result.exit_code == 2 and "--calibration-data" in result.stderr and "judged on" in result.stderr


def test_the_report_table_fits_80_columns_and_keys_long_names_below_it(newcomer):
    """A name too long for the table is cut between words, marked, and given whole below; no line is wider than 80."""
    import shutil

    long_name = "yours_exported_by_the_vendor_with_a_rather_long_descriptive_name.onnx"
    shutil.copy(newcomer / "yours.onnx", newcomer / long_name)
    for model in ("yours.onnx", long_name):
        assert invoke("evaluate", "--model", model, "--data", "my_images", "--results-dir", "res", cwd=newcomer).exit_code == 0
    made = invoke("quantize", "--model", long_name, "--data", "my_images", "--output", "q.onnx", "--results-dir", "res", cwd=newcomer)
    assert made.exit_code == 0, made.output
    assert invoke("evaluate", "--model", "q.onnx", "--data", "my_images", "--results-dir", "res", cwd=newcomer).exit_code == 0
    lines = invoke("report", "--results-dir", "res", cwd=newcomer, columns=80).stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    table = lines[: next(index for index, line in enumerate(lines) if line.startswith("(a) "))]
    assert f"(a) {long_name}" in lines  # the key, whole
    rows = [line for line in table if line.split() and line.split()[0].startswith("yours_exported")]
    assert rows and all(line.split()[0].endswith("…") and "(a)" in line for line in rows)
    assert all(long_name[: len(row.split()[0]) - 1] == row.split()[0][:-1] for row in rows)  # its start, cut before a '_'
    assert all(long_name[len(row.split()[0]) - 1] in "_.-" for row in rows)
    again = invoke("quantize", "--model", long_name, "--data", "my_images", "--output", "q2.onnx", "--results-dir", "res", cwd=newcomer)
    said = " ".join(again.stdout.split())
    assert "1 measured on my_images (test)" in said and "most faithful q.onnx" in said  # the other choice, read from its record


def test_quantize_loads_the_users_model_once(newcomer, monkeypatch):
    """The model is checked before calibration work and quantized from that one load (issue 37: every model loaded once
    per command), whichever backend quantizes it."""
    import collections
    import dataclasses

    from ptq_cli import backends

    loads: collections.Counter = collections.Counter()
    row = backends.TABLE["onnxruntime"]

    def counted(path, options):
        loads[str(path)] += 1
        return row.runtime.load(path, options)

    monkeypatch.setitem(backends.TABLE, "onnxruntime", dataclasses.replace(row, runtime=dataclasses.replace(row.runtime, load=counted)))
    for backend, suffix in (("onnxruntime", ".onnx"), ("pytorch", ".pt")):
        loads.clear()
        made = invoke("quantize", "--model", "yours.onnx", "--data", "my_images", "--backend", backend, "--output", f"q{suffix}", cwd=newcomer)
        assert made.exit_code == 0, made.output
        assert loads["yours.onnx"] == 1, (backend, dict(loads))
