"""`make install`'s uv gets the machine's pip configuration (tools/uv_options.py)."""

import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parent.parent / "tools" / "uv_options.py"
spec = importlib.util.spec_from_file_location("uv_options", TOOL)
assert spec and spec.loader
uv_options = importlib.util.module_from_spec(spec)
spec.loader.exec_module(uv_options)


def test_pip_s_find_links_constraints_and_indexes_become_uv_options_and_missing_paths_are_left_out(tmp_path):
    wheels, constraints = tmp_path / "wheels", tmp_path / "constraints.txt"
    wheels.mkdir()
    constraints.write_text("torch<=2.14\n")
    listed = "\n".join([
        f":env:.find-links='{wheels}'",
        f"global.find-links='{tmp_path / 'elsewhere'}'",
        f"global.constraint='{constraints}'",
        f"global.extra-index-url='file://{tmp_path} file://{tmp_path / 'gone'} https://mirror.example/simple'",
        "global.cert='/etc/ssl/certs/ca-certificates.crt'",
        "global.timeout='60'",
    ])
    assert uv_options.uv_options(listed) == [
        "--find-links", str(wheels),  # the environment's setting over the file's
        "--constraint", str(constraints),
        "--extra-index-url", f"file://{tmp_path}", "--extra-index-url", "https://mirror.example/simple",
    ]


def test_no_pip_configuration_gives_no_option():
    assert uv_options.uv_options("") == []
