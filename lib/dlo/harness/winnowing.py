"""Fingerprints of code, as MOSS takes them (Schleimer, Wilkerson and Aiken, SIGMOD 2003): the
comparison under `dlo.harness.similarity`'s report, apart from what it compares and how it is shown.

Python tokens are normalized (names become one symbol, attribute names after a dot stay, strings
become one symbol, comments and layout are dropped); k-grams of K tokens are hashed with a stable
hash and winnowed with a window of W, which keeps every match of K + W - 1 tokens or more. `share`
is the share of one snippet's fingerprints found anywhere in another.
"""

from __future__ import annotations

import hashlib
import io
import keyword
import tokenize
from dataclasses import dataclass, field

K = 6  # tokens per k-gram: shorter matches are noise
W = 4  # winnowing window: every match of K + W - 1 = 9 tokens or more is seen
_SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER,
         tokenize.ENCODING} | {getattr(tokenize, n) for n in ("FSTRING_MIDDLE", "FSTRING_END") if hasattr(tokenize, n)}
_STRINGS = {tokenize.STRING} | {getattr(tokenize, n) for n in ("FSTRING_START",) if hasattr(tokenize, n)}


def normalized_tokens(source: str) -> list[tuple[str, int, int]]:
    """(token as compared, start, end) for the code of `source`; as far as it tokenizes."""
    starts, pos = [0], 0
    for line in source.splitlines(keepends=True):
        pos += len(line)
        starts.append(pos)
    out: list[tuple[str, int, int]] = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type in _SKIP:
                continue
            if tok.type == tokenize.NAME:
                text = tok.string if keyword.iskeyword(tok.string) or (out and out[-1][0] == ".") else "V"
            elif tok.type in _STRINGS:
                text = "S"
            else:
                text = tok.string
            start = starts[tok.start[0] - 1] + tok.start[1]
            end = starts[min(tok.end[0], len(starts)) - 1] + tok.end[1]
            out.append((text, start, end))
    except (tokenize.TokenError, SyntaxError):
        pass  # unfinished code: what came before counts
    return out


def gram_hash(gram: list[str]) -> int:
    """A stable 64-bit hash of a k-gram (the same bytes every run, unlike hash())."""
    return int.from_bytes(hashlib.blake2b("\x1f".join(gram).encode(), digest_size=8).digest(), "big")


@dataclass
class Code:
    """One snippet: its source, tokens, every k-gram hash (by position) and its winnowed fingerprints."""

    source: str
    tokens: list = field(default_factory=list)
    grams: list = field(default_factory=list)  # hash of the k-gram starting at each token
    fingerprints: set = field(default_factory=set)  # winnowed, boilerplate removed
    own: set = field(default_factory=set)  # every k-gram hash but the boilerplate's (what the page marks)

    @classmethod
    def of(cls, source: str, boilerplate: frozenset = frozenset()) -> Code:
        tokens = normalized_tokens(source)
        words = [t[0] for t in tokens]
        grams = [gram_hash(words[i:i + K]) for i in range(len(words) - K + 1)]
        return cls(source, tokens, grams, winnow(grams) - boilerplate, set(grams) - boilerplate)

    @property
    def all_grams(self) -> set:
        return set(self.grams)


def winnow(grams: list[int], window: int = W) -> set[int]:
    """The robust winnowing of Schleimer et al.: in each window of `window` consecutive hashes, the
    smallest (the rightmost of equals)."""
    chosen, last = set(), -1
    for i in range(max(1, len(grams) - window + 1)):
        span = range(i, min(i + window, len(grams)))
        if not span:
            break
        j = min(span, key=lambda j: (grams[j], -j))
        if j != last:
            chosen.add(grams[j])
            last = j
    return chosen


def share(a: Code, b: Code) -> float:
    """The share of a's fingerprints that occur in b."""
    return len(a.fingerprints & b.all_grams) / len(a.fingerprints) if a.fingerprints else 0.0
