"""Incremental detokenization: the streamed pieces add up to the whole decode, stop strings
are cut and never streamed in part, and decoding work grows linearly with the tokens."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from shardline.engine.detokenizer import Detokenizer

# Byte-level pieces, as a byte-level BPE vocabulary has them: "é" (2 bytes) and "€" (3 bytes)
# also appear split over several tokens, so a token can end in the middle of a character.
PIECES = [b"a", b"b", b" ", b"St", b"OP", b"\n", "é".encode(), "€".encode(), b"\xe2", b"\x82\xac"]
PIECES += [b"\xc3", b"\xa9", b"hello", b" world"]


TOKEN_LISTS = st.lists(st.integers(0, len(PIECES) - 1), max_size=60)


class ByteTokenizer:
    """Decodes ids into the UTF-8 text of their pieces (cut sequences become U+FFFD), and
    counts how many tokens it was asked to decode."""

    def __init__(self) -> None:
        self.decoded_tokens = 0

    def decode(self, ids: list[int]) -> str:
        self.decoded_tokens += len(ids)
        return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


def _stream(ids: list[int], stop: tuple[str, ...], step: int = 1):
    """Feed ``ids`` a few at a time; returns the pieces handed out, whether a stop string was
    hit, and the detokenizer."""
    tokenizer = ByteTokenizer()
    detokenizer = Detokenizer(tokenizer, stop)
    pieces, stopped = [], False
    for end in range(step, len(ids) + step, step):
        delta, stopped = detokenizer.update(ids[:end])
        pieces.append(delta)
        if stopped:
            break
    if not stopped:
        pieces.append(detokenizer.finish(ids))
    return pieces, stopped, detokenizer


@settings(max_examples=300, deadline=None)
@given(TOKEN_LISTS, st.integers(1, 3))
def test_pieces_add_up_to_the_whole_decode(ids, step):
    pieces, stopped, detokenizer = _stream(ids, (), step)
    assert not stopped
    assert "".join(pieces) == detokenizer.text == ByteTokenizer().decode(ids)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, len(PIECES) - 1), max_size=60), st.sampled_from(["StOP", "é€", "a a"])
)
def test_text_ends_before_the_first_stop_string_which_is_never_streamed(ids, stop):
    pieces, stopped, detokenizer = _stream(ids, (stop,))
    whole = ByteTokenizer().decode(ids)
    if stop in whole:
        assert stopped and detokenizer.text == whole[: whole.index(stop)]
    else:
        assert not stopped and detokenizer.text == whole
    streamed = ""
    for piece in pieces:
        streamed += piece
        assert stop not in streamed
        # nothing handed out is later taken back: every prefix is a prefix of the final text
        assert detokenizer.text.startswith(streamed)


def test_a_stop_string_split_over_tokens_is_held_back_then_cut():
    st_, op, a = PIECES.index(b"St"), PIECES.index(b"OP"), PIECES.index(b"a")
    tokenizer = ByteTokenizer()
    detokenizer = Detokenizer(tokenizer, ("StOP",))
    assert detokenizer.update([a]) == ("a", False)
    assert detokenizer.update([a, st_]) == ("", False)  # "St" may begin "StOP"
    assert detokenizer.update([a, st_, op]) == ("", True)
    assert detokenizer.text == "a"


def test_held_back_text_comes_out_when_the_request_ends_without_the_stop():
    st_, b = PIECES.index(b"St"), PIECES.index(b"b")
    detokenizer = Detokenizer(ByteTokenizer(), ("StOP",))
    assert detokenizer.update([b, st_]) == ("b", False)
    assert detokenizer.finish([b, st_]) == "St"
    assert detokenizer.text == "bSt"


def test_decoding_work_grows_linearly_with_the_tokens():
    rng = random.Random(7)
    ids = [rng.randrange(len(PIECES)) for _ in range(2000)]
    _, _, detokenizer = _stream(ids, ("never there",))
    # One window per update: a handful of tokens each, not the whole list.
    assert detokenizer.tokenizer.decoded_tokens < 10 * len(ids)
