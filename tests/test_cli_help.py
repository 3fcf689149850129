from conftest import ptq


def test_help_lists_every_command(tmp_path):
    run = ptq("--help", cwd=tmp_path)
    assert run.returncode == 0
    for command in ("convert", "calibrate", "quantize", "evaluate", "report"):
        assert command in run.stdout


def test_quantize_help_explains_options(tmp_path):
    run = ptq("quantize", "--help", cwd=tmp_path)
    assert run.returncode == 0
    for option in ("--dtype", "--weight-dtype", "--per-channel", "--method", "--calibration", "--output"):
        assert option in run.stdout
