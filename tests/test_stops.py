"""Stop strings split across tokens never leak into the output."""

from hypothesis import given, settings
from hypothesis import strategies as st

from imp.text.stops import StopMatcher


def run(chunks, stops):
    m = StopMatcher(stops)
    out = ""
    for c in chunks:
        text, stopped = m.push(c)
        out += text
        if stopped:
            return out, True
    return out + m.flush(), False


def test_stop_split_across_chunks():
    assert run(["Hello wo", "rl", "d! more"], ["world"]) == ("Hello ", True)


def test_held_back_prefix_released_when_it_stops_matching():
    m = StopMatcher(["</end>"])
    assert m.push("abc</") == ("abc", False)
    assert m.push("x") == ("</x", False)


def test_earliest_stop_wins():
    assert run(["a STOP b END"], ["END", "STOP"]) == ("a ", True)


def test_no_stops_passthrough():
    assert run(["a", "b"], []) == ("ab", False)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab\n<>/xé", max_size=40),
    stops=st.lists(st.text(alphabet="ab<>/é", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
def test_chunking_does_not_change_the_result(text, stops, cuts):
    """Any split of the text gives the same output as the whole text at once."""
    pieces, last = [], 0
    for c in sorted(set(min(c, len(text)) for c in cuts)):
        pieces.append(text[last:c])
        last = c
    pieces.append(text[last:])
    whole = run([text], stops)
    assert run(pieces, stops) == whole
    # the stop that completes first wins (as token by token); among those, the earliest start
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    end = min(hits)[0] if hits else None
    expect = text[: min(i for e, i in hits if e == end)] if hits else text
    assert whole == (expect, bool(hits))


def test_matcher_reports_which_stop_hit():
    m = StopMatcher(["END", "STOP"])
    assert m.push("a ST") == ("a ", False)
    assert m.hit == ""
    assert m.push("OP b") == ("", True)
    assert m.hit == "STOP"
