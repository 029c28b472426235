"""A request's bad words as a token-id trie, for the question the sampler asks every step: which
tokens would complete a bad word now? A word's last token is banned when its earlier tokens end
the output so far. The earlier tokens are stored reversed, so the answer walks back from the
output's last token, at most as many tokens as the longest word has: O(that depth + the tokens
banned), whatever the number of words (scanning every word costs O(words x length) per step)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain


class _Node:
    __slots__ = ("children", "banned")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.banned: list[int] = []  # last tokens of the words whose earlier tokens end here


class BadWordsTrie:
    def __init__(self, words: Sequence[Sequence[int]]) -> None:
        self._root = _Node()
        for word in words:
            if not word:
                continue
            node = self._root
            for token in reversed(word[:-1]):
                node = node.children.setdefault(token, _Node())
            if word[-1] not in node.banned:
                node.banned.append(word[-1])

    def banned(self, output: Sequence[int], extra: Sequence[int] = ()) -> list[int]:
        """The tokens to ban after `output` followed by `extra` (a speculator's drafts so far)."""
        node = self._root
        banned = list(node.banned)
        for token in chain(reversed(extra), reversed(output)):
            node = node.children.get(token)  # type: ignore[assignment]
            if node is None:
                break
            banned.extend(node.banned)
        return banned
