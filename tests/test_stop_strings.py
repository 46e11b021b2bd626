"""Stop strings against their definition, at any token split, and at a scale where a
matcher that rescans what it holds back (or every prefix of a long stop) never finishes.

The definition, written here from scratch: after each push, the text so far is the
concatenation of the pushes since the last hit. If a stop string occurs in it, the
push emits the text before the earliest-starting occurrence and reports the hit;
otherwise everything is emitted except the longest suffix that could still begin a
stop string. Nothing of a stop string is ever emitted."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxinfer.base.errors import InvalidOptionError
from mlxinfer.engine.text_stream import StopMatcher
from mlxinfer.engine.options import MAX_STOP_CHARS, MAX_STOPS, GenerationOptions


def by_definition(stops: list[str], pieces: list[str]) -> tuple[list[tuple[str, bool]], str]:
    """(what each push emits and whether it hit a stop, what a flush at the end releases)."""
    out, text, emitted = [], "", 0
    for piece in pieces:
        text += piece
        starts = [text.index(s) for s in stops if s in text]
        if starts:
            assert min(starts) >= emitted  # the definition never takes back what it emitted
            out.append((text[emitted : min(starts)], True))
            text, emitted = "", 0
            continue
        could_begin = [n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])]
        keep = len(text) - max(could_begin, default=0)
        out.append((text[emitted:keep], False))
        emitted = keep
    return out, text[emitted:]


def run(stops: list[str], pieces: list[str]) -> tuple[list[tuple[str, bool]], str]:
    matcher = StopMatcher(stops)
    return [matcher.push(p) for p in pieces], matcher.flush()


CHARS = st.sampled_from("aab\u00e9\n")  # few letters, so stops overlap, repeat and nest
STOPS = st.lists(st.text(CHARS, min_size=1, max_size=6), min_size=1, max_size=4)
PIECES = st.lists(st.text(CHARS, max_size=8), max_size=12)


@settings(max_examples=400, deadline=None)
@given(stops=STOPS, pieces=PIECES)
def test_any_split_matches_the_definition(stops, pieces):
    assert run(stops, pieces) == by_definition(stops, pieces)


@settings(max_examples=200, deadline=None)
@given(stops=STOPS, text=st.text(CHARS, max_size=40), cuts=st.lists(st.integers(0, 40), max_size=10))
def test_one_text_any_token_split_emits_the_text_before_the_first_stop(stops, text, cuts):
    """However the text is cut into tokens, before any hit what is emitted plus what is
    held back is the text itself, and the first hit ends it at the earliest stop."""
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    emitted, rest = run(stops, pieces)
    assert emitted == by_definition(stops, pieces)[0]
    done = []
    for chunk, hit in emitted:
        done.append(chunk)
        if hit:
            break
    else:
        done.append(rest)
    whole = "".join(done)
    assert not any(s in whole for s in stops)
    assert text.startswith(whole)


def hit_by_definition(stops: list[str], pieces: list[str]) -> list[str | None]:
    """Which stop each push hits: of those in the text so far, the earliest-starting, and of
    those the shortest (the one completed first)."""
    out, text = [], ""
    for piece in pieces:
        text += piece
        found = sorted((text.index(s), len(s), s) for s in stops if s in text)
        out.append(found[0][2] if found else None)
        text = "" if found else text
    return out


@settings(max_examples=400, deadline=None)
@given(stops=STOPS, pieces=PIECES)
def test_the_stop_that_was_hit_is_named(stops, pieces):
    matcher = StopMatcher(stops)
    named = []
    for piece in pieces:
        hit = matcher.push(piece)[1]
        assert (matcher.matched is not None) == hit
        named.append(matcher.matched)
    assert named == hit_by_definition(stops, pieces)


def test_no_stops_passes_everything_through():
    assert run([], ["ab", "", "c"]) == ([("ab", False), ("", False), ("c", False)], "")


def test_a_long_stop_string_costs_only_what_is_pushed():
    """A 100,000-character stop string and 200 pushes that are all a prefix of it, then the
    push that completes it: a hang guard (generous: the matcher takes well under a second)."""
    stop = "a" * 99_999 + "b"
    matcher = StopMatcher([stop, "zz"])
    deadline = time.monotonic() + 60
    pieces = ["x" + "a" * 499] + ["a" * 500] * 199
    for piece in pieces:
        assert matcher.push(piece) == ("x" if piece.startswith("x") else "", False)
        assert time.monotonic() < deadline, "pushes cost time that grows with the stop string's length"
    assert matcher.push("b") == ("", True)
    read = sum(map(len, pieces)) + 1
    assert matcher.moves <= 2 * read


@pytest.mark.parametrize("stops,pieces", [
    (["a" * 999 + "b"], ["a" * 998, "c"] * 50),  # a long held prefix falls back to nothing, again and again
    (["ab" * 500 + "c"], ["ab" * 499, "abd"] * 50),
    (["a" * k + "b" for k in range(1, 17)], ["a"] * 2000),  # 16 nested stops, none completed
])
def test_moves_are_at_most_twice_the_characters_read(stops, pieces):
    """Aho-Corasick's bound: each character read is one move, and every fallback along a
    failure link undoes an earlier step down the trie."""
    matcher = StopMatcher(stops)
    for piece in pieces:
        assert not matcher.push(piece)[1]
    assert matcher.moves <= 2 * sum(map(len, pieces))


@pytest.mark.parametrize("stop,fact", [
    ([f"s{i}" for i in range(MAX_STOPS + 1)], f"at most {MAX_STOPS}"),
    (["x" * (MAX_STOP_CHARS + 1)], f"at most {MAX_STOP_CHARS}"),
])
def test_stop_strings_are_bounded(stop, fact):
    with pytest.raises(InvalidOptionError) as e:
        GenerationOptions(stop=tuple(stop))
    assert "stop" in str(e.value) and fact in str(e.value) and "\n" not in str(e.value)


def test_stop_strings_at_their_limits_are_taken():
    GenerationOptions(stop=tuple(f"s{i}" for i in range(MAX_STOPS - 1)) + ("x" * MAX_STOP_CHARS,))
