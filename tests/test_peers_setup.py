"""benchmarks/peers.py on a model of the user's own (`--model`, `--calibration`, `--test`): the workdir it lays out and the
inputs every tool is given. The comparison itself runs the peers (minutes, AIMET in its own environment): `make peers`."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from synthetic import channel_mean_classifier, photo_folder, smooth_photos

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import peers  # noqa: E402


def test_own_model_is_copied_its_photo_folders_linked_and_its_inputs_follow_the_preprocessing_options(tmp_path: Path) -> None:
    model = channel_mean_classifier(tmp_path / "mine.onnx", layout="NHWC", size=16)
    calibration = smooth_photos(tmp_path / "cal", count=5, seed=1, suffix=".png")
    photo_folder(calibration, count=2, size=16, seed=3)  # .jpg beside the .png: both are images
    test = smooth_photos(tmp_path / "judge", count=4, seed=2)
    before = sorted(path.name for path in calibration.iterdir())
    workdir = tmp_path / "work"

    peers.own_workdir(workdir, model, calibration, test)
    peers.own_workdir(workdir, model, calibration, test)  # a second run reuses the same workdir
    assert (workdir / "mine.onnx").read_bytes() == model.read_bytes() and not (workdir / "mine.onnx").is_symlink()
    assert (workdir / "calibration").resolve() == calibration.resolve() and (workdir / "test").resolve() == test.resolve()
    assert sorted(path.name for path in calibration.iterdir()) == before  # nothing written into the user's folders

    subject = peers.Subject(workdir, "mine.onnx", {"--scale": "0.00784313725", "--mean": "1", "--std": "1"})
    assert subject.preprocessing == ["--scale", "0.00784313725", "--mean", "1", "--std", "1"]  # what `ptq quantize` is given
    assert len(peers.photos(subject, "calibration")) == 7  # the .png and the .jpg: what every tool calibrates on
    signed = peers.photos(subject, "test")
    unit = peers.photos(peers.Subject(workdir, "mine.onnx", {"--preprocess": "unit"}), "test")
    assert signed.shape == unit.shape == (4, 16, 16, 3)  # the model's own layout
    np.testing.assert_allclose(signed, unit * 2 - 1, atol=1e-5)  # x/127.5 - 1 against x/255, on the same photos
    assert signed.min() < 0 <= unit.min()

    with pytest.raises(SystemExit, match="already exists and is not"):
        peers.own_workdir(workdir, model, test, test)  # the workdir's calibration link points elsewhere: refused, not relinked
    (tmp_path / "elsewhere").mkdir()
    other = channel_mean_classifier(tmp_path / "elsewhere" / "mine.onnx", layout="NHWC", size=16, classes=2)
    with pytest.raises(SystemExit, match="is another model"):
        peers.own_workdir(workdir, other, calibration, test)  # another model under the same name: refused, not compared stale
    (tmp_path / "broken.onnx").write_bytes(b"not a model")
    with pytest.raises(SystemExit, match=r"broken\.onnx: not a valid ONNX model"):
        peers.own_workdir(tmp_path / "work2", tmp_path / "broken.onnx", calibration, test)
