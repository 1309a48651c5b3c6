"""Progress of a long Hessian collection: tokens done / total, tokens per second, the pass and
the time left (``global_factors(..., progress=True)`` or a callable)."""
from __future__ import annotations

import sys
from dataclasses import dataclass

__all__ = ["Progress", "progress_bar", "format_duration"]


@dataclass(frozen=True)
class Progress:
    """Where a :func:`~bakron.hessian.global_factors` run stands, after one batch.

    ``kind``: the pass (``"kfac"``, ``"refine_out"``, ``"refine_in"``, or ``"split"`` for a
    pass that caches boundary states); ``pass_index`` of ``passes`` (1-based); tokens (real,
    unpadded rows) done and in all, over all passes; ``seconds`` since the run started.
    """

    kind: str
    pass_index: int
    passes: int
    tokens_done: int
    tokens_total: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_done / self.seconds if self.seconds > 0 else 0.0

    @property
    def seconds_left(self) -> float:
        r = self.tokens_per_second
        return (self.tokens_total - self.tokens_done) / r if r > 0 else float("inf")

    def __str__(self) -> str:
        return (f"pass {self.pass_index}/{self.passes} ({self.kind}): {self.tokens_done}/"
                f"{self.tokens_total} tokens, {self.tokens_per_second:.0f} tokens/s, about "
                f"{format_duration(self.seconds_left)} left")


def format_duration(seconds: float) -> str:
    """``45 s``, ``6 min``, ``1.5 h``."""
    if seconds != seconds or seconds == float("inf"):
        return "?"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class _Bar:
    """A tqdm bar over the tokens of all passes (on stderr, only when it is a terminal)."""

    def __init__(self, stream=None):
        self.stream = sys.stderr if stream is None else stream
        self.bar = None
        self.done = 0

    def __call__(self, p: Progress):
        if self.bar is None:
            try:
                from tqdm import tqdm
            except ImportError:   # tqdm comes with the llm extra; without it, stay quiet
                self.bar = False
                return
            isatty = getattr(self.stream, "isatty", None)
            self.bar = tqdm(total=p.tokens_total, unit="tok", unit_scale=True,
                            file=self.stream, dynamic_ncols=True, leave=False,
                            disable=not (isatty is not None and isatty()))
        if self.bar is False:
            return
        self.bar.set_description(f"Hessians, pass {p.pass_index}/{p.passes} {p.kind}",
                                 refresh=False)
        self.bar.update(p.tokens_done - self.done)
        self.done = p.tokens_done

    def close(self):
        if self.bar:
            self.bar.close()


def progress_bar(progress):
    """The per-batch callback for ``progress=`` (``None``/``False``: none; ``True``: a bar;
    a callable: itself), and a function that closes it."""
    if progress is None or progress is False:
        return None, lambda: None
    if progress is True:
        bar = _Bar()
        return bar, bar.close
    if callable(progress):
        return progress, lambda: None
    raise ValueError(f"progress must be True, False, None or a callable, got {progress!r}")
