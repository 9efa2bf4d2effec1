"""A plain progress bar on stderr, for command-line work that takes more than a few seconds.

    from cuflash._progress import Progress

    with Progress(total=702, label="compiling") as bar:
        for item in work:
            ...
            bar.advance()            # or bar.advance(n), or bar.update(done) with a count

    # as a callback for code that reports (done, total):
    with Progress(label="compiling") as bar:
        check_all(archs, progress=bar.callback)

On a terminal it redraws one line (``label [#####.....] 312/702 44% 0:01:42, ~0:02:10 left``)
at most every ``interval`` seconds; elsewhere (CI logs, pipes) it prints a line at each tenth
of the way and at the end, so logs stay short. It never writes to stdout, so the command's
output stays clean for pipes. ``Progress(..., enabled=False)`` is silent.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """A progress bar; see the module docstring."""

    def __init__(self, total: int | None = None, label: str = "", *,
                 stream: TextIO | None = None, interval: float = 0.2, width: int = 30,
                 enabled: bool = True):
        self.total, self.label, self.done = total, label, 0
        self.stream = sys.stderr if stream is None else stream
        self.interval, self.width, self.enabled = interval, width, enabled
        self.start = time.monotonic()
        self._last_draw = 0.0
        self._last_tenth = -1
        self._printed = None  # the count of the last line printed (not on a terminal)
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())

    # -- reporting -----------------------------------------------------------------------

    def advance(self, n: int = 1) -> None:
        """``n`` more items are done."""
        self.update(self.done + n)

    def update(self, done: int, total: int | None = None) -> None:
        """``done`` items are done (of ``total``, if it is known only now)."""
        if total is not None:
            self.total = total
        self.done = done
        self._draw(final=False)

    def callback(self, done: int, total: int | None = None, *args: Any, **kwargs: Any) -> None:
        """``update`` under the signature ``(done, total, ...)`` that reporting code calls."""
        self.update(done, total)

    def close(self) -> None:
        self._draw(final=True)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- drawing -------------------------------------------------------------------------

    def line(self) -> str:
        """The bar as text (without a newline)."""
        elapsed = time.monotonic() - self.start
        head = f"{self.label} " if self.label else ""
        if not self.total:
            return f"{head}{self.done} done {_clock(elapsed)}"
        frac = min(1.0, self.done / self.total)
        filled = int(round(frac * self.width))
        text = (f"{head}[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
                f"{frac:4.0%} {_clock(elapsed)}")
        if 0 < frac < 1:
            text += f", ~{_clock(elapsed * (1 - frac) / frac)} left"
        return text

    def _draw(self, final: bool) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if self.tty:
            if final or now - self._last_draw >= self.interval:
                self._last_draw = now
                self.stream.write("\r" + self.line() + ("\n" if final else ""))
                self.stream.flush()
            return
        tenth = int(10 * self.done / self.total) if self.total else -1
        if (final and self._printed != self.done) or tenth > self._last_tenth:
            self._last_tenth, self._printed = tenth, self.done
            self.stream.write(self.line() + "\n")
            self.stream.flush()
