"""Calibration sets drawn from the real training batches."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from conftest import CIFAR, assert_clean_failure, cifar_split, ptq, ptq_ok

from ptq_cli.datasets import cifar10 as cifar
from ptq_cli.services.make.calibration import build_calibration_set, load_calibration_set


@pytest.fixture(scope="module")
def calibration_sets(tmp_path_factory, assets):
    work = tmp_path_factory.mktemp("calibration")
    for name, seed in (("a", 42), ("b", 42), ("c", 7)):
        ptq_ok("calibrate", "--samples-per-class", "20", "--seed", str(seed), "--output", f"{name}.npz", cwd=work)
    return {name: load_calibration_set(work / f"{name}.npz") for name in "abc"}


def test_exactly_n_per_class(calibration_sets):
    for calibration in calibration_sets.values():
        assert np.bincount(calibration.labels, minlength=10).tolist() == [20] * 10
        assert calibration.images.shape == (200, 32, 32, 3) and calibration.images.dtype == np.uint8  # pixels; preprocessing per model
        assert calibration.pixel_range == (0, 255)


def test_same_seed_same_indices_other_seed_other_indices(calibration_sets):
    assert np.array_equal(calibration_sets["a"].indices, calibration_sets["b"].indices)
    assert np.array_equal(calibration_sets["a"].images, calibration_sets["b"].images)
    assert not np.array_equal(calibration_sets["a"].indices, calibration_sets["c"].indices)


def test_images_and_labels_are_those_of_the_training_batches(calibration_sets):
    train = cifar_split("train")
    calibration = calibration_sets["c"]
    assert np.array_equal(calibration.images, train.images[calibration.indices].astype(np.float32))
    assert np.array_equal(calibration.labels, train.labels[calibration.indices])
    assert calibration.split == "train" and calibration.dataset == str(CIFAR)


def test_no_test_image_in_calibration_set(calibration_sets):
    test_hashes = {hashlib.sha1(image.tobytes()).digest() for image in cifar_split("test").images}
    for calibration in calibration_sets.values():
        pixels = calibration.images.astype(np.uint8)
        assert not any(hashlib.sha1(image.tobytes()).digest() in test_hashes for image in pixels)


def test_calibration_never_reads_the_test_batch(tmp_path, assets):
    # A data directory without test_batch: calibration must not notice.
    data = tmp_path / "no-test-batch"
    data.mkdir()
    for name in (*cifar.TRAIN_BATCHES, cifar.META_FILE):
        (data / name).symlink_to(CIFAR / name)
    calibration = build_calibration_set(cifar.Cifar10(data), samples_per_class=5, seed=1)
    assert len(calibration.labels) == 50


def test_calibrate_json_summary(tmp_path, assets):
    run = ptq_ok("calibrate", "--samples-per-class", "3", "--seed", "5", "--output", "c.npz", "--json", cwd=tmp_path)
    summary = __import__("json").loads(run.stdout)
    assert summary["samples"] == 30 and summary["seed"] == 5
    assert summary["per_class"]["truck"] == 3
    assert summary["split"] == "train"


def test_too_many_samples_per_class_is_refused(tmp_path, assets):
    run = ptq("calibrate", "--samples-per-class", "5001", "--output", "c.npz", cwd=tmp_path)
    assert_clean_failure(run, 2, "--samples-per-class")
    assert "5000" in run.stderr
    assert not (tmp_path / "c.npz").exists()
