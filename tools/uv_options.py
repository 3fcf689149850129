"""Prints the uv options that carry this machine's pip configuration, for `make install`.

uv reads neither pip.conf nor PIP_* variables, and a machine may keep there what pip would honour: a folder of local
wheels (find-links: the CPU build of torch), caps (constraint), or another index. Paths that do not exist are left
out (pip only warns about them; uv would stop)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

# pip's setting -> uv's option; "extra-index-url" and "find-links" may hold several values.
OPTIONS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links", "constraint": "--constraint"}


def _exists(value: str) -> bool:
    if value.startswith("file://"):
        return os.path.exists(value.removeprefix("file://"))
    return "://" in value or os.path.exists(value)


def uv_options(pip_config: str) -> list[str]:
    """uv's options for the lines of `pip config list` (`scope.name='value'`), the environment's (`:env:`) over the files'."""
    settings: dict[str, str] = {}
    for line in sorted(pip_config.splitlines(), key=lambda line: line.startswith(":env:")):
        key, separator, value = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        if separator and name in OPTIONS:
            settings[name] = value.strip().strip("'\"")
    return [word for name, value in settings.items() for item in value.split() if _exists(item) for word in (OPTIONS[name], item)]


if __name__ == "__main__":
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False).stdout
    print(shlex.join(uv_options(listed)))
