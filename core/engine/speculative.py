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

from shardline.config.schema import MAX_SPECULATIVE_TOKENS, SpeculativeConfig

#: Earlier occurrences of the shortest run a lookup compares, the latest first (a bound on
#: its time where a short run is common).
MAX_CANDIDATES = 32


class NgramIndex:
    """Where each run of ``min_n`` tokens of one request occurred (the position of the token
    that followed each occurrence), kept up to date as the request's tokens grow: one entry
    per token, indexed once; the run that ends the tokens is indexed when a token follows it.
    A lookup compares the latest :data:`MAX_CANDIDATES` occurrences of the last ``min_n``
    tokens by how far the match with the last tokens reaches back (up to ``max_n``). It keeps
    the request's tokens itself, so a lookup is given only those added since the last."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._tokens: list[int] = []
        self._follows: dict[tuple[int, ...], list[int]] = {}

    @property
    def num_tokens(self) -> int:
        """How many of the request's tokens the index holds."""
        return len(self._tokens)

    def lookup(self, new_tokens: list[int], limit: int) -> list[int]:
        """With ``new_tokens`` (the request's tokens after the :attr:`num_tokens` held; all of
        them the first time) added: up to ``limit`` tokens that followed the earlier
        occurrence of the longest run of last tokens (of ``min_n`` to ``max_n``; the latest of
        equal ones) among the latest candidates; [] when the last ``min_n`` tokens occurred
        nowhere before."""
        tokens = self._tokens
        self._index(new_tokens)
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

    def _index(self, new_tokens: list[int]) -> None:
        """Add ``new_tokens``, and index the runs each of them follows."""
        tokens, shortest = self._tokens, self.min_n
        start = len(tokens)
        tokens += new_tokens
        for follows in range(max(start, shortest), len(tokens)):
            run = tuple(tokens[follows - shortest : follows])
            self._follows.setdefault(run, []).append(follows)


class NgramProposer:
    """Proposes a request's drafts by prompt lookup (see the module docstring), and how many
    a request may propose a step (its draft length, kept with the request):
    ``config.num_speculative_tokens`` at first, then as ``config.draft_schedule`` says."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def new_index(self) -> NgramIndex:
        """The lookup state of one request (kept with the request)."""
        return NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max)

    def first_length(self) -> int:
        """A new request's draft length."""
        return self.config.num_speculative_tokens

    def next_length(self, length: int, proposed: int, accepted: int) -> int:
        """A request's draft length after a step that checked ``proposed`` drafts (at most
        ``length``) and accepted ``accepted``: unchanged (constant), or 2 more when every
        draft was accepted and 1 fewer when one was not (heuristic; 1 to
        MAX_SPECULATIVE_TOKENS)."""
        if self.config.draft_schedule == "constant" or proposed == 0:
            return length
        if accepted == proposed:
            return min(length + 2, MAX_SPECULATIVE_TOKENS)
        return max(length - 1, 1)

    def propose(self, index: NgramIndex, new_tokens: list[int], limit: int) -> list[int]:
        """At most ``limit`` drafts that follow the request's tokens, ``new_tokens`` those
        ``index`` does not hold yet (the caller keeps ``limit`` within the draft length)."""
        return index.lookup(new_tokens, limit)
