"""Records that scale to ImageNet-size class counts: a 1000-class evaluation keeps its confusion matrix as
its nonzero cells, reads back with every figure checked, and stays small."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from synthetic import channel_mean_classifier, colour_images, invoke

from ptq_cli import settings
from ptq_cli.errors import PtqError
from ptq_cli.services.measure import evaluation_records

CLASSES = 1000


@pytest.fixture
def thousand_classes(tmp_path, monkeypatch) -> Path:
    """A classifier with 1000 class scores (the first three are the colours) and colour images labelled 0-2."""
    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path / "cache"))
    channel_mean_classifier(tmp_path / "wide.onnx", classes=CLASSES)
    images, labels = colour_images(20, seed=2)
    np.savez(tmp_path / "wide.npz", test_images=images, test_labels=labels, class_names=np.array([f"class {index}" for index in range(CLASSES)]))
    return tmp_path


def test_a_1000_class_record_keeps_the_nonzero_cells_and_stays_under_200_kb(thousand_classes):
    result = invoke("evaluate", "--model", "wide.onnx", "--data", "wide.npz", "--results-dir", "res", "--json", cwd=thousand_classes)
    assert result.exit_code == 0, result.output
    (path,) = (thousand_classes / "res").glob("wide.onnx-*.json")
    assert path.stat().st_size <= 200_000
    stored = json.loads(path.read_text())
    assert stored["confusion_matrix"] == [] and sum(count for _, _, count in stored["confusion_counts"]) == 60
    record = evaluation_records.read_record(path)
    confusion = record.confusion()
    assert confusion.shape == (CLASSES, CLASSES) and int(np.trace(confusion)) == record.correct == 60
    assert record.per_class_accuracy[:3] == [100.0, 100.0, 100.0] and record.per_class_accuracy[3] is None


def test_an_edited_cell_or_one_outside_the_classes_is_refused(thousand_classes):
    assert invoke("evaluate", "--model", "wide.onnx", "--data", "wide.npz", "--results-dir", "res", cwd=thousand_classes).exit_code == 0
    (path,) = (thousand_classes / "res").glob("wide.onnx-*.json")
    stored = json.loads(path.read_text())
    for cells, problem in (([[0, 1, 20], *stored["confusion_counts"][1:]], "does not add up"), ([[0, CLASSES, 20], *stored["confusion_counts"][1:]], "outside")):
        path.write_text(json.dumps({**stored, "confusion_counts": cells}))
        with pytest.raises(PtqError, match=problem):
            evaluation_records.read_record(path)


def test_per_class_lists_the_measured_classes_that_lose_the_most(thousand_classes):
    result = invoke("evaluate", "--model", "wide.onnx", "--data", "wide.npz", "--results-dir", "res", "--per-class", cwd=thousand_classes)
    assert result.exit_code == 0, result.output
    assert "3 of 1,000 classes" in " ".join(result.stdout.split())  # the title, however it wraps
    listed = re.findall(r"│ class (\d+) ", result.stdout)
    assert sorted(listed) == ["0", "1", "2"]  # the 997 classes without images are not listed


def test_a_class_with_too_few_images_says_nothing_about_the_model(thousand_classes):
    from dataclasses import replace

    assert invoke("evaluate", "--model", "wide.onnx", "--data", "wide.npz", "--results-dir", "res", cwd=thousand_classes).exit_code == 0
    (path,) = (thousand_classes / "res").glob("wide.onnx-*.json")
    record = evaluation_records.read_record(path)
    # One image of class 5 (predicted as class 0): a -100-point class beside three of 20 images each.
    one_more = replace(record, confusion_counts=[*record.confusion_counts, [5, 0, 1]], images=61,
                       per_class_accuracy=[*record.per_class_accuracy[:5], 0.0, *record.per_class_accuracy[6:]])
    assert evaluation_records.measured_classes(one_more) == [0, 1, 2]
    assert evaluation_records.classes_to_show(one_more, None) == [0, 1, 2]


def test_a_record_declaring_many_classes_is_checked_without_a_classes_squared_array(thousand_classes, monkeypatch):
    assert invoke("evaluate", "--model", "wide.onnx", "--data", "wide.npz", "--results-dir", "res", cwd=thousand_classes).exit_code == 0
    (path,) = (thousand_classes / "res").glob("wide.onnx-*.json")
    stored = json.loads(path.read_text())
    names = [f"class {index}" for index in range(100_000)]  # 10^10 cells if it were made whole
    path.write_text(json.dumps({**stored, "class_names": names, "per_class_accuracy": stored["per_class_accuracy"] + [None] * (100_000 - CLASSES)}))
    monkeypatch.setattr(evaluation_records.EvaluationRecord, "confusion", lambda self: pytest.fail("made the whole matrix"))
    assert len(evaluation_records.read_record(path).class_names) == 100_000
    path.write_text(json.dumps({**stored, "confusion_counts": [[0, 0, 10**30]]}))
    with pytest.raises(PtqError, match="not a ptq evaluation record"):
        evaluation_records.read_record(path)
