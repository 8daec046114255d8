"""The bench's workloads (pure): every ``--workload``'s document lengths, per round and rank.

``skewed``, ``balanced``, ``mixed`` and ``sample:FILE.json`` (batches drawn from a length sample), the
``long`` workload's global stream (one document over every rank beside short ones), and the check of
``--workload`` names. ``demo``'s batches are the demo trainer's own packing (``demo_data``).
"""

from __future__ import annotations

WORKLOADS = ("skewed", "balanced", "mixed", "long", "demo")
"""``--workload`` names (besides ``sample:FILE.json``)."""


ALONE = {"long": "its methods differ", "demo": "its model and settings differ"}
"""Workloads that run alone, and why."""


BALANCED_SHIFT = 0.12
"""``balanced``: odd ranks hold documents of ``(1/2 + 0.12)`` and ``(1/2 - 0.12)`` of their tokens,
even ranks two halves: ``1 + 4 * 0.12**2`` = 1.058 times the pairs, 1.028 max/mean on two ranks."""


def skewed_batch(rank: int, tokens: int, short_docs: int):
    """Document lengths of ``rank``'s micro-batch: one long document on even ranks, ``short_docs``
    equal ones (the remainder spread over the first) on odd ranks."""
    if rank % 2 == 0:
        return [tokens]
    base = tokens // short_docs
    return [base + (1 if i < tokens % short_docs else 0) for i in range(short_docs)]


def balanced_batch(rank: int, tokens: int) -> list[int]:
    """``balanced``: two halves on even ranks, halves shifted by ``BALANCED_SHIFT`` on odd ones."""
    shift = round(BALANCED_SHIFT * tokens) if rank % 2 else 0
    half = tokens // 2
    return [n for n in (half + shift, tokens - half - shift) if n > 0]


def demo_lengths() -> list[int]:
    """The demo's documents as token counts: the Python help topics (``pydoc_data.topics``) at 3
    characters a token, about what the demo's byte-level BPE gives."""
    from ...training.offline_corpus import pydoc_topics

    return [max(1, len(text) // 3) for text in pydoc_topics()]


def sample_lengths(workload: str) -> list[int]:
    """The length sample of ``mixed`` or ``sample:FILE.json`` (a JSON list of positive ints)."""
    if workload == "mixed":
        return demo_lengths()
    from ..length_samples import load_lengths  # (simulate's checks: a bool or a float was a length here)

    return load_lengths(workload.removeprefix("sample:"), "--workload sample:FILE.json").tolist()


def drawn_batches(lengths: list[int], world: int, tokens: int, seed: int) -> list[list[int]]:
    """One batch of ``mixed`` / ``sample:``: documents drawn (with replacement, ``seed``) from
    ``lengths`` and packed rank after rank, ``tokens`` each; a document that does not fit is cut
    at the end of the rank (its rest is dropped: each rank packs alone)."""
    import random

    rng = random.Random(seed)
    batches = []
    for _ in range(world):
        batch, room = [], tokens
        while room:
            n = min(rng.choice(lengths), room)
            batch.append(n)
            room -= n
        batches.append(batch)
    return batches


def workload_batches(workload: str, world: int, tokens: int, short_docs: int, rounds: int) -> list[list[list[int]]]:
    """``[round][rank]`` document lengths of every round (warm-up rounds first) of a workload."""
    if workload == "skewed":
        return [[skewed_batch(r, tokens, short_docs) for r in range(world)]] * rounds
    if workload == "balanced":
        return [[balanced_batch(r, tokens) for r in range(world)]] * rounds
    lengths = sample_lengths(workload)
    return [drawn_batches(lengths, world, tokens, seed) for seed in range(rounds)]


def default_long_tokens(world: int, tokens: int) -> int:
    """The long document's default length: all of the global batch but ``tokens / 2`` (short
    documents, half before it and half after)."""
    return world * tokens - tokens // 2


def long_documents(world: int, tokens: int, long_tokens: int, short_len: int) -> list[int]:
    """Document lengths of the global stream of ``world * tokens`` tokens: short documents of
    ``short_len`` tokens (the last of each run shorter), one of ``long_tokens`` starting in rank 0's
    row and ending in the last rank's, then short ones."""
    rest = world * tokens - long_tokens
    before, after = rest // 2, rest - rest // 2
    if not (0 <= rest and before < tokens and after < tokens):
        raise ValueError(f"--long-tokens {long_tokens} must be at most {world * tokens} and above "
                         f"{world * tokens - 2 * tokens + 1} so that the long document starts in rank 0's row "
                         f"and ends in rank {world - 1}'s ({world} ranks of {tokens} tokens)")

    def shorts(n):
        return [short_len] * (n // short_len) + ([n % short_len] if n % short_len else [])

    return shorts(before) + [long_tokens] + shorts(after)


def check_workload_names(args, parser) -> None:
    """``--workload``: known names or ``sample:FILE.json`` (readable, a list of lengths); ``long``
    only alone."""
    names = args.workload.split(",")
    for name in names:
        if name.startswith("sample:"):
            try:
                sample_lengths(name)
            except ValueError as e:
                parser.error(str(e))
        elif name not in WORKLOADS:
            parser.error(f"--workload takes {', '.join(WORKLOADS)} or sample:FILE.json (several separated by commas), "
                         f"got {name!r}")
    for name, why in ALONE.items():
        if name in names and len(names) > 1:
            parser.error(f"--workload {name} runs alone ({why})")
    if len(set(names)) != len(names):
        parser.error(f"--workload names a workload twice: {args.workload!r}")
