"""Streamed detokenization: whole characters only, stop strings never sent, the text equals the
decoded whole."""

from __future__ import annotations

from cachetune.server.text import TextStream


class ByteTokenizer:
    """Token i is byte i; decoding joins the bytes as UTF-8 (an incomplete character is U+FFFD)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")

    def ids(self, text: str) -> list[int]:
        return list(text.encode())


def stream(text: str, stops=None) -> tuple[list[str], TextStream]:
    tok = ByteTokenizer()
    s = TextStream(tok, stops)
    pieces = [s.add(t) for t in tok.ids(text)]
    pieces.append(s.flush())
    return [p for p in pieces if p], s


def test_pieces_join_to_the_decoded_text_and_never_split_a_character():
    pieces, s = stream("naïve café — 東京")
    assert "".join(pieces) == "naïve café — 東京" == s.text
    assert all("\ufffd" not in p for p in pieces)


def test_the_text_ends_before_the_first_stop_string_and_nothing_of_it_is_sent():
    pieces, s = stream("alpha beta STOP gamma", stops=["STOP", "gamma"])
    assert "".join(pieces) == "alpha beta " and s.stopped
    assert not any("S" in p for p in pieces)  # the stop's start was held back, then dropped


def test_a_held_back_partial_stop_that_is_not_a_stop_is_sent_later():
    pieces, s = stream("a ST b STX", stops=["STOP"])
    assert "".join(pieces) == "a ST b STX" and not s.stopped


def test_no_stops_means_every_piece_goes_out_at_once():
    tok = ByteTokenizer()
    s = TextStream(tok)
    assert [s.add(t) for t in tok.ids("abc")] == ["a", "b", "c"]


class SpaceDroppingTokenizer:
    """Like SentencePiece: a token is " word", and a decode drops the leading space of its first."""

    words = ["alpha", "beta", "gamma", "delta"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(" " + self.words[i] for i in ids).removeprefix(" ")


def test_decoding_a_window_of_the_tail_gives_the_same_text_as_decoding_everything():
    tok = SpaceDroppingTokenizer()
    ids = [0, 1, 2, 3, 2, 1, 0]
    s = TextStream(tok)
    pieces = [s.add(i) for i in ids] + [s.flush()]
    assert "".join(pieces) == tok.decode(ids) == "alpha beta gamma delta gamma beta alpha"
    assert pieces[1] == " beta"  # the space a decode of the tail alone would drop is kept
