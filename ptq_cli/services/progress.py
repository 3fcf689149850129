"""Progress reporting from services: a plain (done, total) callback, no terminal code."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

ProgressCallback = Callable[[int, int], None]  # (steps done, steps total)
# A request's long phases each get a callback from this, given what the phase does (the CLI draws a bar for it).
ProgressBar = Callable[[str], AbstractContextManager[ProgressCallback | None]]


@contextmanager
def no_progress_bar(description: str) -> Iterator[ProgressCallback | None]:  # noqa: ARG001  the ProgressBar signature
    yield None


class Steps:
    """Counts finished steps of a known total and tells the callback, if there is one."""

    def __init__(self, total: int, progress: ProgressCallback | None) -> None:
        self.total, self.done, self.progress = total, 0, progress

    def __call__(self) -> None:
        self.done += 1
        if self.progress:
            self.progress(min(self.done, self.total), self.total)  # estimates of the total may fall short
