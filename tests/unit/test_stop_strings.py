"""Stop strings (worker/detokenizer.py's match_stop, shared by the offline engine and the
frontend's text streams): the cut is where a stop string first ends, whatever the order of the
stops and however the text is split into tokens, and what is left holds no stop string."""

import hypothesis.strategies as st
from hypothesis import given, settings

from folio.worker.detokenizer import match_stop

ALPHABET = "ab c"


def feed(pieces: list[str], stops: list[str], include: bool) -> tuple[str, str | None]:
    text = ""
    for p in pieces:
        text, stop = match_stop(text, p, stops, include)
        if stop is not None:
            return text, stop
    return text, None


@settings(max_examples=400, deadline=None)
@given(text=st.text(ALPHABET, min_size=1, max_size=24), stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4),
       min_size=1, max_size=4), cuts=st.lists(st.integers(1, 5), min_size=1, max_size=8), include=st.booleans(),
       data=st.data())
def test_the_cut_is_where_a_stop_first_ends(text, stops, cuts, include, data):
    pieces, at = [], 0
    for c in cuts * len(text):
        if at >= len(text):
            break
        pieces.append(text[at:at + c])
        at += c
    got = feed(pieces, stops, include)
    one_by_one = feed(list(text), stops, include)
    shuffled = data.draw(st.permutations(stops))
    assert got == one_by_one  # however the text was split into tokens
    assert got[0] == feed(pieces, shuffled, include)[0]  # whatever the order of the stops
    out, stop = got
    ends = [text.find(s) + len(s) for s in stops if s in text]
    if not ends:
        assert (out, stop) == (text, None)
        return
    first_end = min(ends)
    assert stop is not None and text.startswith(out)
    kept = out[: len(out) - len(stop)] if include else out
    assert not any(s in kept for s in stops)  # what is left holds no stop string
    assert len(kept) + len(stop) == first_end  # cut where a stop first ends


def test_the_first_in_the_text_wins_not_the_first_listed():
    assert match_stop("", " OptionParser", ["e", " "], False) == ("", " ")
    assert match_stop("", " OptionParser", ["Parser", "Opt"], False) == (" ", "Opt")
    assert match_stop("", "abcd", ["abcd", "bc"], True) == ("abc", "bc")
