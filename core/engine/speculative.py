"""Drafts for speculative decoding by prompt lookup (``speculative.method: ngram``).

A request's next tokens are guessed from its own tokens: find the latest earlier place where
its last ``n`` tokens occurred (``n`` from ``prompt_lookup_max`` down to
``prompt_lookup_min``, the longest run found wins) and propose the tokens that followed
there. Text that repeats what it has seen (an answer quoting or editing its prompt, code,
lists, summaries) is guessed well; elsewhere nothing is found and the request decodes one
token a step as before. The model checks every draft in the same step as the last token
(:attr:`shardline.interfaces.ModelRunner.speculative_decoding`), choosing at each as if the
drafts before it were the request's tokens, so a request's tokens (greedy or seeded) are those
it would produce without drafts.
"""

from __future__ import annotations

from shardline.config.schema import SpeculativeConfig


class NgramIndex:
    """Where each run of ``min_n`` to ``max_n`` tokens of one request last occurred: for
    each run, the position of the token that followed it. Kept up to date as the request's
    tokens grow (each token indexed once); the run that ends the tokens is not indexed until
    a token follows it."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self._sizes = range(max_n, min_n - 1, -1)
        self._latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self._sizes}
        #: Runs followed by a token at a position below this are indexed.
        self._indexed_until = 0

    def lookup(self, tokens: list[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the latest earlier occurrence of the longest
        run of last tokens found (``tokens`` begins with the tokens seen before); [] when
        none is found."""
        self._index(tokens)
        length = len(tokens)
        for n in self._sizes:
            if n > length:
                continue
            follows = self._latest[n].get(tuple(tokens[length - n :]))
            if follows is not None:
                return tokens[follows : follows + limit]
        return []

    def _index(self, tokens: list[int]) -> None:
        """Index the runs followed by the tokens at positions up to the last one."""
        for follows in range(max(self._indexed_until, 1), len(tokens)):
            for n in self._sizes:
                if n <= follows:
                    self._latest[n][tuple(tokens[follows - n : follows])] = follows
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
