"""When a dispatch's exchanges are issued, so that relay rounds queue behind nothing.

Collectives of one process group complete in the order they were issued (NCCL runs a
communicator's on one stream), the same order on every rank. A wave whose K/V is relayed
(``Wave.relays``) issues its relay rounds only once its first round has arrived, so they would queue
behind whatever was issued meanwhile: other waves' inputs, the other nano-batch's, earlier returns.
``IssueQueue`` holds every exchange asked for while such relay rounds are pending (from the launch of
the first round until ``relays_issued``, the serve functions' ``pools_ready`` hook) and then issues
them in the order asked: they travel during that wave's kernel, and relay rounds wait for their own
first round only. Without relays nothing is held. One queue serves a dispatch's waves
(``wave_schedule``) or both nano-batches of a forward (``pingpong``); every rank asks in the same
order, so every rank issues alike. (A held exchange is packed when issued: a profile shows it inside
the span that released it.)
"""

from __future__ import annotations

__all__ = ["IssueQueue"]


class IssueQueue:
    """Exchanges by key: ``issue`` asks for one, ``take`` returns what its launch returned (issuing
    everything held first if it was held, so no order of asking and taking waits on an exchange
    never issued)."""

    def __init__(self):
        self.pending = set()  # owners whose relayed first round is issued, their relay rounds not yet
        self.held = []  # (key, launch, owner) in the order asked
        self.issued = {}  # key -> what its launch returned, until taken

    def issue(self, key, launch, *, opens_relays_of=None) -> None:
        """Call ``launch()`` (which starts an exchange) now, or, while relay rounds are pending, once
        they are issued. ``opens_relays_of``: the wave or nano-batch (any object) whose relayed first
        round this is, its relay rounds to follow before its kernel."""
        self.held.append((key, launch, opens_relays_of))
        self._release(flush=False)

    def relays_issued(self, owner) -> None:
        """``owner``'s relay rounds were issued: what is held goes now, unless another's are pending."""
        self.pending.discard(owner)
        self._release(flush=False)

    def take(self, key):
        """What ``key``'s launch returned (the pending exchange), issued now if it was held."""
        if key not in self.issued:
            self._release(flush=True)
        if key not in self.issued:
            raise RuntimeError(f"distca: the exchange {key!r} was never asked for")  # (a schedule bug: it would hang)
        return self.issued.pop(key)

    def _release(self, *, flush: bool) -> None:
        while self.held and (flush or not self.pending):
            key, launch, owner = self.held.pop(0)
            self.issued[key] = launch()
            if owner is not None:
                self.pending.add(owner)
