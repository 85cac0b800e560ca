"""What `python -m trainer` prints says what it does: notes on cut records and the held-out split,
the loss verdict at the rounding it is shown with, and progress that does not fill a log with
redrawn bars (plain lines every N steps when stderr is not a terminal, the time left estimated
after the compiling steps), the held-out evaluation's included."""
from __future__ import annotations

import io
import re

from trainer.cli import main
from trainer.cli.progress import Progress
from trainer.cli.summary import fell as _fell


def test_max_len_eval_max_and_progress_lines(tmp_path, capsys):
    rc = main(["--steps", "4", "--max-len", "20", "--eval-max", "20", "--eval-answers", "0", "--out", str(tmp_path / "o")])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    # every record lost its answer to the cut, but --loss-on all trains on all 2850 of them: no "skipped"
    assert "3000 truncated chat records lost every assistant token" in cap.err
    assert "will be skipped" not in cap.err and "are skipped" not in cap.err
    assert "still trained on" in cap.err
    assert "2850 training sequences, 150 held out (20 of them evaluated: --eval-max 20)" in cap.out
    assert "20 sequences" in cap.out
    # stderr is no terminal here: plain lines, one per step of this 4-step run, no carriage returns
    lines = [line for line in cap.err.splitlines() if line.startswith("train: step ")]
    assert [re.match(r"train: step (\d+)/4", x).group(1) for x in lines] == ["1", "2", "3", "4"], cap.err
    assert "\r" not in cap.err
    # the first two steps compile kernels: no estimate from them
    assert "time left estimated from step 3" in lines[0] and "time left estimated from step 3" in lines[1]
    assert re.search(r"\d+:\d\d remaining", lines[2]) and "done" in lines[3]
    # the held-out evaluations before and after show their own progress, counted in sequences
    evals = [line for line in cap.err.splitlines() if line.startswith("held-out loss: sequence ")]
    assert len(evals) >= 2 and all(re.match(r"held-out loss: sequence \d+/20 ", x) for x in evals), cap.err
    assert sum(x.startswith("held-out loss: sequence 20/20 ") and "done" in x for x in evals) == 2, cap.err
    m = re.search(r"held-out loss \(all tokens\): (\d\.\d{4}) before -> (\d\.\d{4}) after  \((x[\d.]+),", cap.out)
    verdict = "fell" if float(m.group(2)) < float(m.group(1)) else "DID NOT FALL"
    assert f"the held-out loss {verdict} ({m.group(3)})" in cap.out


def test_a_loss_shown_as_x1_00_did_not_fall(tmp_path, capsys):
    rc = main(["--preset", "tiny", "--steps", "1", "--lr", "1e-9", "--eval-max", "4", "--eval-answers", "0",
               "--no-progress", "--out", str(tmp_path / "o")])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert "(x1.00, 4 sequences)" in cap.out
    assert "the held-out loss DID NOT FALL (x1.00)" in cap.out and "loss fell" not in cap.out
    assert "train: step" not in cap.err and "held-out loss: sequence" not in cap.err    # --no-progress


def test_the_verdict_agrees_with_the_losses_shown():
    """0.2053 -> 0.2045 fell, and its ratio is shown with the digits that say so (not x1.00)."""
    from trainer.cli.summary import ratio_text
    assert _fell(0.2053, 0.2045) and ratio_text(0.2053, 0.2045) == "x0.9961"
    assert _fell(1.0, 0.13) and ratio_text(1.0, 0.13) == "x0.13"
    assert not _fell(0.20531, 0.20529) and ratio_text(0.20531, 0.20529) == "x1.00"   # shown equal: no fall
    assert not _fell(1.0, 1.0) and not _fell(1.0, 1.2) and not _fell(1.0, float("nan"))


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_redraws_only_on_a_terminal():
    log = io.StringIO()
    p = Progress(total=100, initial=0, file=log)
    for _ in range(100):
        p.set_postfix_str("loss=1.0")
        p.update(1)
    p.close()
    lines = log.getvalue().splitlines()
    assert [int(re.match(r"train: step (\d+)/100", x).group(1)) for x in lines] == list(range(10, 101, 10))
    assert "\r" not in log.getvalue() and lines[-1].endswith("done, loss=1.0")

    term = FakeTerminal()
    p = Progress(total=5, initial=0, file=term, redraw_s=0)
    for _ in range(5):
        p.update(1)
    p.write("  step 5: held-out loss 1.0")
    p.close()
    text = term.getvalue()
    assert text.count("\r") >= 5 and "[" + "#" * 24 + "]" in text and "  step 5: held-out loss 1.0\n" in text
    assert text.endswith("\n") and "train: step" not in text

    log = io.StringIO()                 # updates of several units at once still print each tenth crossed
    p = Progress(total=150, initial=0, file=log, desc="held-out loss", unit="sequence")
    for _ in range(9):
        p.update(16)
    p.update(6)
    shown = [int(re.match(r"held-out loss: sequence (\d+)/150", x).group(1)) for x in log.getvalue().splitlines()]
    assert shown == [16, 32, 48, 64, 80, 96, 112, 128, 144, 150], log.getvalue()

    off = io.StringIO()
    p = Progress(total=5, enabled=False, file=off)
    p.update(5)
    p.close()
    assert off.getvalue() == ""


def test_a_short_run_evaluates_no_more_than_it_trains_on(tmp_path, capsys):
    """Without --eval-max, a 2-step run of 4 sequences a step evaluates 8 held-out sequences, not
    all 150: on a slow device its evaluation would otherwise take far longer than its training."""
    rc = main(["--steps", "2", "--max-len", "20", "--eval-answers", "0", "--no-progress", "--out", str(tmp_path / "o")])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert "2850 training sequences, 150 held out (8 of them evaluated: --eval-max 8)" in cap.out
