"""Deterministic token text: the next word is a pure function of the previous two and a seed.

Why this shape: the gateway resumes a broken stream by asking another backend to continue
from "prompt + text already delivered". That only splices seamlessly if generation has no
hidden state beyond the text itself. Here the state is exactly the last two words of the
context (plus the seed), so for any prompt P and any k:

    generate(P, n)[k:] == generate(P + "".join(generate(P, n)[:k]), n - k)

Tokens are vocabulary words with a leading space (" alpha"), so concatenating tokens onto a
prompt never glues two words together, and splitting on whitespace recovers the words.
Hashing uses CRC-32 and a 64-bit mixer, never Python's per-process salted ``hash``, so two
sim processes (two "backends") produce the same text for the same request.

Token ids (`token_id`): a vocabulary word is its index + 1, any other word 1000 + its key, so
an id gives back the key the generator needs (`id_key`) and a prompt of ids (vLLM's
`return_token_ids`, a completions `prompt` list) continues exactly as its text would; id 0 is
the "no word" padding, which a chat prompt's ids use as the boundary of what generation
continues (`protocol.chat_prompt_ids`).
"""

from __future__ import annotations

import zlib

# 200 distinct lowercase ASCII words without spaces. Changing this list changes every
# generated text; tests pin its size and uniqueness.
_WORDS = """
    alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november
    oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu
    beta gamma epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau
    upsilon phi chi psi omega
    red orange yellow green blue indigo violet amber azure crimson cyan gold ivory jade
    lilac magenta navy olive pearl ruby scarlet silver teal umber
    ant bear cat dog eagle falcon gecko heron ibis jaguar koala lemur marten newt otter
    panda quail raven seal tiger urchin viper walrus yak zebra
    apple banana cherry date elder fig grape hazel kiwi lemon mango nectar olivine peach
    plum quince raisin sage thyme vanilla walnut
    river stream brook lake ocean sea bay cove estuary fjord glacier harbor island lagoon
    marsh mesa canyon valley ridge summit
    north south east west spring summer autumn winter dawn dusk noon night
    stone iron copper tin bronze steel glass paper cloth wood
    one two three four five six seven eight nine ten
    quick slow bright dark calm wild soft loud warm cold
    cloud rain snow wind storm thunder frost mist hail breeze
    run walk jump swim fly climb read write sing build
"""
VOCAB: tuple[str, ...] = tuple(_WORDS.split())

_TOKENS: tuple[str, ...] = tuple(" " + w for w in VOCAB)
_MASK = (1 << 64) - 1


def word_key(word: str) -> int:
    """Stable 32-bit key of one word (identical in every process, unlike ``hash``)."""
    return zlib.crc32(word.encode())


_VOCAB_KEYS: tuple[int, ...] = tuple(word_key(w) for w in VOCAB)
_PAD = 0  # key standing in for "no word" when the context has fewer than two words
_IDS = {w: i + 1 for i, w in enumerate(VOCAB)}
FIRST_OOV_ID = 1000  # ids of words outside the vocabulary: 1000 + the word's key


def _mix(a: int, b: int, seed: int) -> int:
    """64-bit avalanche of (a, b, seed): murmur3's finaliser after an odd-constant combine."""
    x = (a * 0x9E3779B97F4A7C15 ^ b * 0xC2B2AE3D27D4EB4F ^ seed * 0x165667B19E3779F9) & _MASK
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & _MASK
    x ^= x >> 33
    return x


def count_words(text: str) -> int:
    """Number of whitespace-separated words: the sim's notion of a token count."""
    return len(text.split())


def tail_keys(text: str) -> tuple[int, int]:
    """Keys of the last two words of ``text`` (padded when it has fewer than two)."""
    # rsplit with maxsplit=2 touches only the end of a long prompt.
    words = text.rsplit(maxsplit=2)[-2:]
    if len(words) == 2:
        return word_key(words[0]), word_key(words[1])
    if len(words) == 1:
        return _PAD, word_key(words[0])
    return _PAD, _PAD


def token_id(word: str) -> int:
    """A word's token id: its vocabulary index + 1, else 1000 + its key (lossless)."""
    i = _IDS.get(word)
    return i if i is not None else FIRST_OOV_ID + word_key(word)


def text_ids(text: str) -> list[int]:
    """The token ids of ``text``'s words."""
    return [token_id(w) for w in text.split()]


def id_key(tid: int) -> int:
    """The word key of token id ``tid`` (0, and anything unknown, is the padding)."""
    if 1 <= tid <= len(VOCAB):
        return _VOCAB_KEYS[tid - 1]
    return tid - FIRST_OOV_ID if tid >= FIRST_OOV_ID else _PAD


def ids_tail_keys(ids: list[int]) -> tuple[int, int]:
    """`tail_keys` of a prompt given as token ids: the keys of its last two ids."""
    a = id_key(ids[-2]) if len(ids) >= 2 else _PAD
    b = id_key(ids[-1]) if ids else _PAD
    return a, b


class TokenGen:
    """Stateful producer of the continuation of one context; state is two word keys
    (``keys``: given as such, for a prompt of token ids)."""

    __slots__ = ("_a", "_b", "_seed")

    def __init__(self, context: str, seed: int, keys: tuple[int, int] | None = None) -> None:
        self._a, self._b = tail_keys(context) if keys is None else keys
        self._seed = seed & _MASK

    def next(self) -> str:
        """The next token's text, e.g. ``" alpha"``."""
        i = _mix(self._a, self._b, self._seed) % len(_TOKENS)
        self._a, self._b = self._b, _VOCAB_KEYS[i]
        return _TOKENS[i]


def piece_id(piece: str) -> int:
    """The id of one generated token's text (``" alpha"`` -> 1)."""
    return token_id(piece[1:])


def generate(context: str, seed: int, n: int) -> list[str]:
    """The first ``n`` tokens continuing ``context`` under ``seed``."""
    gen = TokenGen(context, seed)
    return [gen.next() for _ in range(n)]
