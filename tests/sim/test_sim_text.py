"""Deterministic token text: the property stream resume relies on."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pulsegate.sim.text import VOCAB, TokenGen, count_words, generate, tail_keys

_words = st.lists(st.sampled_from([*VOCAB[:20], "Hello,", "world!", "naïve", "42"]), max_size=8)


def test_vocab_is_200_distinct_plain_words() -> None:
    """The vocabulary has 200 unique lowercase ASCII words, none containing spaces."""
    assert len(VOCAB) == 200
    assert len(set(VOCAB)) == 200
    assert all(w.isascii() and w.isalpha() and w.islower() for w in VOCAB)


def test_golden_output_is_stable_across_processes() -> None:
    """Output is pinned: no salted hash, so every sim process generates the same text."""
    assert "".join(generate("hello world", 0, 8)) == (
        " rain wood romeo jaguar soft otter thunder silver"
    )


def test_tokens_are_vocab_words_with_a_leading_space() -> None:
    """Every token is ' ' + a vocabulary word."""
    vocab = set(VOCAB)
    for tok in generate("a b c", 3, 300):
        assert tok[0] == " " and tok[1:] in vocab


def test_seed_changes_the_text() -> None:
    """Different seeds give different continuations of the same prompt."""
    assert generate("hello world", 0, 16) != generate("hello world", 1, 16)


def test_only_the_last_two_words_matter() -> None:
    """The state is the last two words: longer prompts with the same tail continue alike."""
    assert generate("x y alpha bravo", 0, 10) == generate("bravo   zulu alpha\nbravo ", 0, 10)
    assert tail_keys("") == tail_keys("   ")


@given(prompt=_words, n=st.integers(1, 40), k=st.integers(0, 40), seed=st.integers(-5, 2**70))
def test_resume_from_any_point_yields_the_remaining_tokens(
    prompt: list[str], n: int, k: int, seed: int
) -> None:
    """generate(P, n)[k:] == generate(P + first k tokens' text, n - k) for every k."""
    k = min(k, n)
    p = " ".join(prompt)
    full = generate(p, seed, n)
    assert generate(p + "".join(full[:k]), seed, n - k) == full[k:]


def test_tokengen_matches_generate() -> None:
    """The incremental generator and the list helper agree."""
    gen = TokenGen("one two", 9)
    assert [gen.next() for _ in range(20)] == generate("one two", 9, 20)


def test_count_words() -> None:
    """A token count is the number of whitespace-separated words."""
    assert count_words(" alpha  bravo\ncharlie ") == 3
    assert count_words("") == 0
