"""Dispatch: a plan's CA-tasks on their servers, as this rank's list of waves.

Each rank is both a *source* (its tokens' q, k, v live here, and their output must come back here)
and a *server* (it computes the CA-tasks the plan gives it). Per layer, forward:

1. sources pack, per destination server, the query rows of their moved tasks and the K/V rows that
   server lacks (``num_key_value_heads`` heads, each token once per (source, server) pair) into one
   buffer, and one uneven all-to-all moves them;
2. each server builds one fused varlen batch from its own tokens and what it received, runs the
   kernel once, and keeps the outputs of its local tasks;
3. one all-to-all returns the other outputs to their sources.

Backward mirrors it. In ``saved`` mode a server keeps its fused q, out and log-sum-exp and its K/V
pool (each token once), so only dO travels out and dQ, dK, dV travel back (K/V gradients of a token
used by several tasks or servers are summed). In ``resend`` mode servers keep nothing: sources keep
their own q, k, v, out and log-sum-exp and send them again with dO, trading bytes for flat server
memory.

A plan may split CA-tasks along keys (``planning.key_split``): a query row then gets several
partial outputs, which return with their log-sum-exp and merge at the source; backward runs every
tile with the row's merged output and log-sum-exp (sent with dO in ``saved`` mode, resent in
``resend`` mode) and sums the row's dQ partials.

A plan may relay K/V (``Plan.relays``, ``planning.relay_trees``): a server that received a prefix
forwards it to the next servers of its tree in one more exchange per tree level, right after the
first (``phases.relay_kv``), and in the backward each level's K/V gradients go back to the server
that forwarded them, summed into its own rows, before the first round's go back to the holders
(``phases.relay_kv_grads``); ``resend`` mode relays the K/V again before its backward kernel.

The index tables are in ``tables``, the exchange plumbing in ``exchange``, the phases in ``phases``,
and the schedules that run them in ``wave_schedule`` (overlap ``none`` / ``wave``) and
``pingpong``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..planning import DocumentPieces, Plan, kv_kept, kv_received, query_sends, wave_plans
from ..planning.relay_trees import plan_kv_sends
from .tables import DispatchCounters, LocalDocuments, Wave, build_wave, kv_store_tables

__all__ = ["Dispatch", "build_dispatch"]


@dataclass(eq=False)
class Dispatch:
    """A forward's dispatch on this rank: its waves, in execution order (one wave without overlap).

    ``overlap="wave"`` runs ``[local tasks, first half] [remote tasks, 1] [remote tasks, 2] [local
    tasks, second half]`` (``planning.splits.wave_plans``): both remote waves' inputs are launched
    first, so they travel while the first local half computes, the second remote wave's inputs
    arrive while the first computes, and the outputs of the remote waves travel back while the
    later waves compute. Backward runs the waves in reverse with the same overlap.
    """

    waves: list[Wave]
    counters: DispatchCounters
    overlap: str = "none"
    kv_received: np.ndarray | None = None  # [ranks] K/V tokens each server receives per layer, all waves
    queries_sent: int = 0  # query tokens crossing ranks per layer, all ranks and waves (planning.query_sends)
    kv_kept: np.ndarray | None = None  # [ranks] distinct K/V tokens each server keeps for backward (planning.kv_kept)
    backward: "Dispatch | None" = None
    """The dispatch the backward runs, when it is planned apart from the forward's (``None``: the same).
    ``pipeline_schedule="cad_1f1b"`` pools a backward tick's CA-tasks over the micro-batches that run
    their backward together, which are not the ones that ran their forward together; both are built
    over the same local documents and in ``resend`` mode, so the backward needs nothing a server kept."""

    @property
    def keeps_kv_once(self) -> bool:
        """Several waves in ``saved`` mode: backward keeps the local K/V once and each received K/V row
        once (``tables.kv_store_tables``), not every wave's pool, and rebuilds the pools from them."""
        return len(self.waves) > 1 and self.waves[0].backward_mode == "saved"

    @property
    def kv_rounds(self) -> int:
        """K/V exchange rounds of a layer's forward, over the waves (1 + a wave's relay rounds)."""
        return max(1 + len(w.relays) for w in self.waves)

    @property
    def kv_tokens_moved(self) -> int:
        """K/V tokens crossing ranks per layer, all ranks (the waves may each send a prefix)."""
        return int(self.kv_received.sum())


def build_dispatch(plan: Plan, pieces: DocumentPieces, local: LocalDocuments, rank: int, device, *,
                   overlap: str = "none", counters: DispatchCounters | None = None, block: int = 1,
                   **settings) -> Dispatch:
    """The waves of ``plan`` (over every rank's ``pieces``) on ``rank``, whose documents are
    ``local`` (see ``Dispatch``); ``settings`` go to every ``Wave``. ``counters`` may be shared with
    another dispatch (ping-pong's two nano-batches); ``block``: the wave cut of a local task lands
    on a multiple of it from the task's start. Under ``plan.window`` (the widest sliding window of
    the model's layers) tasks carry only the K/V it sees."""
    counters = counters if counters is not None else DispatchCounters()
    named = wave_plans(plan, block) if overlap == "wave" else [("all", plan)]
    waves, received, queries_sent, every_transfer = [], np.zeros(plan.num_ranks, dtype=np.int64), 0, []
    for name, sub in named:
        transfers, sends = plan_kv_sends(sub, pieces), query_sends(sub)  # K/V along the plan's relay trees, if any
        received += kv_received(transfers, plan.num_ranks)
        every_transfer.append(transfers)
        queries_sent += sends.tokens()  # a row whose tiles fall in two waves is sent in each
        wave = build_wave(sub, transfers, local, rank, device, sends=sends, counters=counters, name=name, **settings)
        # A wave runs no collective when nothing crosses ranks in it (the same on every rank: the
        # plan is), with any overlap: a colocated plan ("auto" on a balanced step) costs no
        # all-to-all; a local task may still need K/V of its document held on another rank.
        wave.local_only = sub.moved_queries() == 0 and transfers.tokens() == 0
        waves.append(wave)
    # Each wave brings the K/V its tasks need: a server's tasks of one document in several waves get
    # its prefix in each. Backward keeps every K/V row once, what the plan's memory budget counts.
    dispatch = Dispatch(waves, counters, overlap, received, queries_sent, kv_kept(every_transfer, plan.num_ranks))
    if dispatch.keeps_kv_once:
        as_tensor = lambda x: None if x is None else torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64)).to(device)
        for wave, (keep, store) in zip(waves, kv_store_tables(every_transfer, rank, local.docs.num_key_tokens)):
            wave.keep_kv_rows, wave.kv_store_rows = as_tensor(keep), as_tensor(store)
    return dispatch
