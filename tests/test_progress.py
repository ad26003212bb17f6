"""Progress bars in a log file are whole lines, few of them; on a terminal they redraw in place (progress.py)."""

import io
import time

from diffspec import progress
from diffspec.evaluation import _bar as eval_bar
from diffspec.training.store import _progress_bar as store_bar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(bar, n: int) -> None:
    for _ in range(n):
        bar.update(1)
    bar.close()


def test_log_file_gets_whole_lines_not_carriage_returns(capsys):
    # make-data's and eval-drafter's bars write to stderr: here a captured, non-terminal stream, as under nohup
    _run(store_bar(500, 0, True), 500)
    _run(eval_bar(300, "drafting", True), 300)
    err = capsys.readouterr().err
    assert "\r" not in err  # tqdm's in-place redraw would put every update on one endless line
    lines = err.splitlines()
    assert all(line.strip() for line in lines)
    # a fast loop: the first state and the last (within LOG_INTERVAL_S), not a line per update
    assert len(lines) <= 6, lines
    assert any("500/500" in line for line in lines)
    # eval-drafter's bar vanishes at close on a terminal (leave=False); in a log its last state stays
    assert any("300/300" in line for line in lines), lines


def test_log_lines_keep_a_long_description_whole_and_nested_bars_clean():
    out = io.StringIO()
    desc = "drafting (prompt-lookup+/a/long/path/to/some/drafter/folder/that/goes/on/and/on/drafter)"
    outer = progress.progress_bar(3, "target answers", file=out)
    inner = progress.progress_bar(5732, desc, file=out)  # a second bar open below the first: tqdm moves the cursor
    _run(inner, 5732)
    _run(outer, 3)
    text = out.getvalue()
    assert "\x1b" not in text and "\r" not in text
    assert any(desc in line and "5732/5732" in line for line in text.splitlines())  # no width cut the counts off


def test_log_file_lines_are_spaced_by_the_interval(monkeypatch):
    monkeypatch.setattr(progress, "LOG_INTERVAL_S", 0.05)
    out = io.StringIO()
    bar = progress.progress_bar(40, "steps", file=out)
    for _ in range(40):
        time.sleep(0.005)
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert 2 < len(lines) < 40  # some redraws (0.2 s at one a 0.05 s), never one an update
    assert "40/40" in lines[-1]


def test_terminal_redraws_in_place():
    out = _Terminal()
    _run(progress.progress_bar(50, "steps", file=out), 50)
    assert "\r" in out.getvalue()


def test_disabled_bar_writes_nothing():
    out = io.StringIO()
    _run(progress.progress_bar(50, "steps", enabled=False, file=out), 50)
    assert out.getvalue() == ""


def test_a_postfix_in_a_log_rides_on_the_next_line():
    # bench labels every run before it starts: in a log that must not be a line a run
    out = io.StringIO()
    bar = progress.progress_bar(200, None, unit="run", file=out)
    for i in range(200):
        bar.set_postfix_str(f"prompt {i}")
        bar.update()
    bar.set_postfix(last=1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) <= 4, lines
    assert "200/200" in lines[-1] and "last=1" in lines[-1]
    term = _Terminal()  # a terminal redraws the label at once
    bar = progress.progress_bar(5, None, file=term)
    before = len(term.getvalue())
    bar.set_postfix_str("now")
    assert "now" in term.getvalue()[before:]
    bar.close()
