"""Progress bars for the long commands (train-drafter, make-data, bench, eval-drafter, profile): tqdm, made fit for
a terminal and for a log file alike.

On a terminal the bar redraws itself in place, as tqdm does. On anything else (a file under `nohup`, a pipe, CI's
log) tqdm would write every redraw after a carriage return on one endless line: a 35-minute training run left a
100 kB line of ~900 bars. There each redraw is its own line instead, at most one every `LOG_INTERVAL_S` seconds (and
the last state when the bar closes); a new postfix (bench's run in progress) rides on the next line, not one of its
own."""

from __future__ import annotations

import functools
import sys
from typing import Optional, TextIO

LOG_INTERVAL_S = 30.0  # a stream that is not a terminal gets a line at most this often
TTY_INTERVAL_S = 0.1   # tqdm's own default on a terminal


def is_terminal(stream) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (ValueError, OSError):  # a closed stream
        return False


_CURSOR_UP = "\x1b[A"  # what tqdm writes to reach a bar drawn below another (two bars open at once)


class _Lines:
    """A stream for tqdm that turns its in-place redraws into whole lines: the carriage returns and the padding that
    overwrites a longer previous bar are dropped, and each non-empty write ends its line."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def write(self, text: str) -> None:
        line = text.replace("\r", "").replace(_CURSOR_UP, "").rstrip()
        if line:
            self.stream.write(line + "\n")

    def flush(self) -> None:
        flush = getattr(self.stream, "flush", None)
        if flush:
            flush()


@functools.lru_cache(maxsize=None)
def _log_bar_class():
    """tqdm whose postfix waits for the next line (a terminal redraws it at once, where that costs no line)."""
    from tqdm import tqdm

    class LogBar(tqdm):
        def set_postfix(self, ordered_dict=None, refresh=True, **kwargs):
            super().set_postfix(ordered_dict, refresh=False, **kwargs)

        def set_postfix_str(self, s="", refresh=True):
            super().set_postfix_str(s, refresh=False)

    return LogBar


def progress_bar(total: Optional[int], desc: Optional[str], unit: str = "it", enabled: bool = True, initial: int = 0,
                 file: Optional[TextIO] = None, leave: bool = True):
    """A tqdm bar on `file` (default stderr); a silent stand-in when not `enabled`."""
    from tqdm import tqdm

    stream = file if file is not None else sys.stderr
    if is_terminal(stream):
        return tqdm(total=total, initial=initial, desc=desc, unit=unit, disable=not enabled, leave=leave, file=stream,
                    dynamic_ncols=True, mininterval=TTY_INTERVAL_S)
    # in a log a bar that would vanish at close (leave=False) keeps its last line: a log has nothing to clear, and its
    # final state is the line worth reading; no ncols there (a width would cut the counts of a long description);
    # maxinterval: tqdm's monitor forces no redraw sooner than the interval
    return _log_bar_class()(total=total, initial=initial, desc=desc, unit=unit, disable=not enabled, leave=True,
                            file=_Lines(stream), dynamic_ncols=False, mininterval=LOG_INTERVAL_S,
                            maxinterval=LOG_INTERVAL_S)
