"""The key guard's memo of the states after a token: the same verdicts, asked once or twice; bounded."""

from __future__ import annotations

import constrain
from constrain.match.keys import AFTER_KEPT, KeyState
from constrain.testing import token_ids


def test_the_state_after_a_token_is_kept_and_stays_right(smol_tokenizer):
    info = constrain.tokenizer_info(smol_tokenizer)
    (quote,) = token_ids(smol_tokenizer, '"')
    again = KeyState.initial(info).advance_bytes(b'{"a": 1, "a')
    other = KeyState.initial(info).advance_bytes(b'{"a": 1, "b')
    assert again is not None and other is not None
    for _ in range(2):  # asked twice (a drawn token's check, then its acceptance): the same answers
        assert again.advance(quote) is None  # completes the key the object has
        assert other.advance(quote) == other.advance_bytes(b'"') is not None
    assert again._after == {quote: None}
    for token in range(1000, 1000 + 3 * AFTER_KEPT):
        other.advance(token)
    assert 0 < len(other._after) <= AFTER_KEPT
