"""Stop strings and regexes across deltas, with hold-back."""

from __future__ import annotations

import pytest

from constrain.decode.stopping import StopText
from constrain.errors import RegexError


def _run(stop: StopText, deltas: list[str]) -> tuple[str, bool, list[str]]:
    shown, stopped = [], False
    for delta in deltas:
        update = stop.feed(delta)
        shown.append(update.text)
        if update.stopped:
            stopped = True
            break
    if not stopped:
        shown.append(stop.flush())
    return "".join(shown), stopped, shown


def test_stop_string_spanning_deltas_is_cut_and_never_shown():
    text, stopped, shown = _run(StopText(stop=["</answer>"]), ["The value", " is 4</", "ans", "wer> and more"])
    assert (text, stopped) == ("The value is 4", True)
    assert shown[1] == " is 4"  # "</" held back while it could start the stop string
    assert all("<" not in s for s in shown)


def test_held_back_text_is_released_when_it_cannot_be_a_stop():
    text, stopped, shown = _run(StopText(stop=["STOP"]), ["ab S", "T", "x done"])
    assert (text, stopped) == ("ab STx done", False)
    assert shown[:2] == ["ab ", ""]


def test_earliest_of_several_stops_wins():
    text, stopped, _ = _run(StopText(stop=["bb", "a"]), ["xxbbya"])
    assert (text, stopped) == ("xx", True)


def test_stop_regex_with_partial_matches():
    stop = StopText(stop_regex=[r"END\d+;"])
    assert stop.feed("text EN").text == "text "
    assert stop.feed("D4").text == ""
    update = stop.feed("2; tail")
    assert (update.text, update.stopped, update.matched) == ("", True, "END42;")
    text, stopped, _ = _run(StopText(stop_regex=[r"\n\n"]), ["a\n", "b\n", "\nc"])
    assert (text, stopped) == ("a\nb", True)


def test_bad_stops_fail_at_construction():
    with pytest.raises(ValueError, match="non-empty"):
        StopText(stop=[""])
    with pytest.raises(ValueError, match="stop is a string or a list of strings, got int"):
        StopText(stop=5)  # type: ignore[arg-type]  # was a bare TypeError: 'int' object is not iterable
    with pytest.raises(ValueError, match="stop_regex patterns must be strings"):
        StopText(stop_regex=[None])  # type: ignore[list-item]
    with pytest.raises(RegexError) as info:
        StopText(stop_regex=["a(b"])
    assert info.value.position == 3
    stop = StopText(stop=["x"])
    stop.feed("x")
    with pytest.raises(ValueError, match="after a stop"):
        stop.feed("y")
