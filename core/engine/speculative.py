"""Drafts for speculative decoding by prompt lookup (``speculative.method: ngram``).

A request's next tokens are guessed from its own tokens: among the latest earlier places
where its last ``prompt_lookup_min`` tokens occurred, take the one where the match with its
last tokens reaches furthest back (up to ``prompt_lookup_max`` tokens; the latest of equal
ones) and propose the tokens that followed there. The index keeps one entry per token, and a
lookup compares at most :data:`MAX_CANDIDATES` places, whatever the lookup sizes.

Text that repeats what it has seen (an answer quoting or editing its prompt, code,
lists, summaries) is guessed well; elsewhere nothing is found and the request decodes one
token a step as before. The model checks every draft in the same step as the last token
(:attr:`shardline.interfaces.ModelRunner.speculative_decoding`), choosing at each as if the
drafts before it were the request's tokens, so a request's tokens (greedy or seeded) are those
it would produce without drafts.
"""

from __future__ import annotations

from shardline.config.schema import SpeculativeConfig

#: Earlier occurrences of the shortest run a lookup compares, the latest first (a bound on
#: its time where a short run is common).
MAX_CANDIDATES = 32


class NgramIndex:
    """Where each run of ``min_n`` tokens of one request occurred (the position of the token
    that followed each occurrence), kept up to date as the request's tokens grow: one entry
    per token, indexed once; the run that ends the tokens is indexed when a token follows it.
    A lookup compares the latest :data:`MAX_CANDIDATES` occurrences of the last ``min_n``
    tokens by how far the match with the last tokens reaches back (up to ``max_n``)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._follows: dict[tuple[int, ...], list[int]] = {}
        #: Runs followed by a token at a position below this are indexed.
        self._indexed_until = 0

    def lookup(self, tokens: list[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the earlier occurrence of the longest run of
        last tokens (of ``min_n`` to ``max_n``; the latest of equal ones) among the latest
        candidates; [] when the last ``min_n`` tokens occurred nowhere before. ``tokens``
        begins with the tokens seen before."""
        self._index(tokens)
        length, shortest = len(tokens), self.min_n
        if length < shortest:
            return []
        places = self._follows.get(tuple(tokens[length - shortest :]))
        if not places:
            return []
        best, longest = places[-1], 0
        for follows in reversed(places[-MAX_CANDIDATES:]):
            run = shortest
            while (
                run < self.max_n
                and follows - run - 1 >= 0
                and tokens[follows - run - 1] == tokens[length - run - 1]
            ):
                run += 1
            if run > longest:
                best, longest = follows, run
                if run == self.max_n:
                    break
        return tokens[best : best + limit]

    def _index(self, tokens: list[int]) -> None:
        """Index the runs followed by the tokens at positions up to the last one."""
        shortest = self.min_n
        for follows in range(max(self._indexed_until, shortest), len(tokens)):
            run = tuple(tokens[follows - shortest : follows])
            self._follows.setdefault(run, []).append(follows)
        self._indexed_until = max(self._indexed_until, len(tokens))


class NgramProposer:
    """Proposes a request's drafts by prompt lookup (see the module docstring), at most
    ``config.num_speculative_tokens`` a step."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def new_index(self) -> NgramIndex:
        """The lookup state of one request (kept with the request)."""
        return NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max)

    def propose(self, index: NgramIndex, tokens: list[int], limit: int) -> list[int]:
        """The drafts that follow ``tokens`` (at most ``limit`` and the configured number)."""
        return index.lookup(tokens, min(limit, self.config.num_speculative_tokens))
