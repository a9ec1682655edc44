"""One log line per rejected message, at most one a second (engines refuse bad input
often when attacked; each refusal used to print a full traceback)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class RateLimitedLog:
    """One WARNING line per rejected message, at most one per ``every_s`` seconds; the
    lines held back are counted in the next one (a flood of bad messages must not flood
    the log: each used to print a full traceback)."""

    def __init__(self, logger: logging.Logger, every_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.every_s, self.clock = logger, every_s, clock
        self.last = float("-inf")
        self.held = 0

    def note(self, line: str) -> None:
        now = self.clock()
        if now - self.last < self.every_s:
            self.held += 1
            return
        more = f" (and {self.held} more since the last line)" if self.held else ""
        self.logger.warning("%s%s", line, more)
        self.last, self.held = now, 0
