"""K/V relays, the what-if of ``planning/relay.py``: relayed sends deliver every K/V token a server
needs exactly once (against ``kv_transfers``, token by token), a rank forwards only what it holds or
received in an earlier round, holders never send more than direct, ``fanout=inf`` is direct, and the
relay's time is ``rank_seconds`` of its loads plus ``collective_s`` per extra round (by hand)."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distca_hf.config import MAX_RELAY_FANOUT
from distca_hf.planning import (DocumentPieces, Plan, PlannerConfig, TimeModel, TokenBytes, kv_transfers, plan_tasks,
                                rank_seconds)
from distca_hf.planning.baselines import pack_pieces
from distca_hf.planning.rank_time import loads_seconds, relay_wait_seconds
from distca_hf.planning.relay import (RelaySends, relay_kv_sends, relay_plan_loads, relay_rank_bytes, relay_rank_seconds,
                                      relay_step_seconds, relay_where_it_helps)
from distca_hf.planning.transfers import KVTransfers, rank_bytes

TOKEN_BYTES = TokenBytes(q=2, kv=4, o=2)
MODEL = TimeModel(linear_s_per_token=1.0, attn_s_per_pair=0.5, task_s=3.0, bytes_per_s=4.0, task_key_s=0.25,
                  collective_s=7.0)


def _tokens(sends) -> Counter:
    """``{(receiver, doc, token): times received}``."""
    return Counter((r, d, t) for r, d, s, e in zip(sends.server.tolist(), sends.doc.tolist(), sends.start.tolist(),
                                                    sends.end.tolist()) for t in range(s, e))


def _held(pieces) -> set:
    return {(r, d, t) for r, d, s, e in zip(pieces.rank.tolist(), pieces.doc.tolist(), pieces.kv_start.tolist(),
                                            pieces.end.tolist()) for t in range(s, e)}


def _check_delivery(relayed, direct, pieces, holder_fanout, fanout) -> Counter:
    """Every server receives each K/V token it needs exactly once, and nothing else; a rank sends
    only tokens it holds (in round 1, to at most ``holder_fanout`` ranks) or received in the round
    before (to at most ``fanout``). Returns ``{(sender, doc, token): times sent}``."""
    assert _tokens(relayed) == _tokens(direct)
    assert max(_tokens(relayed).values(), default=1) == 1
    held, arrived = _held(pieces), {}
    for r, d, s, e, k in zip(relayed.server.tolist(), relayed.doc.tolist(), relayed.start.tolist(),
                             relayed.end.tolist(), relayed.round.tolist()):
        for t in range(s, e):
            arrived[r, d, t] = k
    out = Counter()
    for snd, d, s, e, k in zip(relayed.source.tolist(), relayed.doc.tolist(), relayed.start.tolist(),
                               relayed.end.tolist(), relayed.round.tolist()):
        for t in range(s, e):
            if (snd, d, t) in held:
                assert k == 1
            else:
                assert arrived[snd, d, t] == k - 1
            out[snd, d, t] += 1
    for (snd, d, t), count in out.items():
        assert count <= (holder_fanout if (snd, d, t) in held else fanout)
    return out


@settings(max_examples=120, deadline=None)
@given(docs=st.lists(st.integers(1, 300), min_size=2, max_size=16), ranks=st.integers(2, 6),
       budget=st.sampled_from([48, 96, 160]), tolerance=st.sampled_from([0.0, 0.05, 0.3, "auto"]),
       key_split=st.booleans(), fanout=st.sampled_from([1, 2, 3]), holder_fanout=st.sampled_from([None, 1, 2]))
def test_relay_delivers_every_needed_token_once(docs, ranks, budget, tolerance, key_split, fanout, holder_fanout):
    docs = np.asarray(docs, dtype=np.int64)
    docs = docs[np.cumsum(docs) <= ranks * budget] if docs.sum() > ranks * budget else docs
    if not docs.size:
        return
    pieces = pack_pieces(docs, ranks, budget)
    config = PlannerConfig(tolerance, block=16, key_split=key_split, token_bytes=TOKEN_BYTES, time_model=MODEL)
    plan = plan_tasks(pieces, config)
    direct = kv_transfers(plan, pieces)
    relayed = relay_kv_sends(direct, fanout=fanout, holder_fanout=holder_fanout)

    out = _check_delivery(relayed, direct, pieces, holder_fanout or fanout, fanout)
    held = _held(pieces)
    # holders send at most what they send directly; bytes in total are direct's
    relay_sent, relay_received = relay_rank_bytes(plan, pieces, TOKEN_BYTES, fanout=fanout,
                                                  holder_fanout=holder_fanout, transfers=direct)
    direct_sent, direct_received = rank_bytes(plan, pieces, TOKEN_BYTES, direct)
    from_holdings = np.zeros(ranks)
    for (snd, d, t), count in out.items():
        if (snd, d, t) in held:
            from_holdings[snd] += count * TOKEN_BYTES.kv
    direct_kv = np.bincount(direct.source, weights=(direct.end - direct.start) * TOKEN_BYTES.kv, minlength=ranks)
    assert (from_holdings <= direct_kv).all()
    assert (relay_received == direct_received).all()
    assert relay_sent.sum() == direct_sent.sum() == relay_received.sum()
    # fanout=inf is the direct dispatch
    sent_inf, received_inf = relay_rank_bytes(plan, pieces, TOKEN_BYTES, fanout=math.inf, transfers=direct)
    assert (sent_inf == direct_sent).all() and (received_inf == direct_received).all()
    assert relay_kv_sends(direct, fanout=math.inf).rounds == (1 if direct.source.size else 0)
    seconds, rounds = relay_rank_seconds(plan, pieces, config, fanout=math.inf, transfers=direct)
    assert seconds.tolist() == pytest.approx(rank_seconds(plan, pieces, config, direct).tolist())
    # relays placed by time deliver the same tokens and are never predicted slower than direct
    placed = relay_where_it_helps(plan, pieces, config, transfers=direct)
    _check_delivery(placed, direct, pieces, math.inf, 4)
    assert relay_step_seconds(plan, pieces, config, sends=placed)[0] <= seconds.max() * (1 + 1e-9)


def test_relay_tree_by_hand():
    """Rank 0 holds document 0's 8 tokens; ranks 1..7 each need all of them, rank 4 only the first 4.
    Fanout 2: rank 0 sends to the first two of the tree order (furthest need first, then by rank:
    1 2 3 5 6 7 4), ranks 1 and 2 forward to two each, rank 3 to one (rank 4, tokens [0, 4)):
    three rounds; rank 0 sends 16 tokens instead of 52."""
    ends = [8, 8, 8, 4, 8, 8, 8]
    direct = KVTransfers(np.zeros(7, dtype=np.int64), np.arange(1, 8), np.zeros(7, dtype=np.int64),
                         np.zeros(7, dtype=np.int64), np.array(ends))
    relayed = relay_kv_sends(direct, fanout=2)
    got = {(s, r): (a, b, k) for s, r, a, b, k in zip(relayed.source.tolist(), relayed.server.tolist(),
                                                      relayed.start.tolist(), relayed.end.tolist(),
                                                      relayed.round.tolist())}
    assert got == {(0, 1): (0, 8, 1), (0, 2): (0, 8, 1), (1, 3): (0, 8, 2), (1, 5): (0, 8, 2),
                   (2, 6): (0, 8, 2), (2, 7): (0, 8, 2), (3, 4): (0, 4, 3)}
    assert relayed.rounds == 3
    chain = relay_kv_sends(direct, fanout=2, holder_fanout=1)
    assert chain.rounds == 3 and chain.source.tolist().count(0) == 1
    for bad in (0, MAX_RELAY_FANOUT + 1):  # (past the bound: int64 overflow in the trees before)
        with pytest.raises(ValueError, match=f"fanout must be an integer from 1 to {MAX_RELAY_FANOUT} or math.inf"):
            relay_kv_sends(direct, fanout=bad)
    with pytest.raises(ValueError, match="holder_fanout must be"):
        relay_kv_sends(direct, fanout=2, holder_fanout=1.5)


def test_relay_seconds_add_collective_per_extra_round_and_the_wait_along_the_trees():
    """A 2000-token document over 4 ranks of 500, planned at tolerance 0: its relayed layer is
    ``rank_seconds`` of the relayed loads plus ``collective_s`` for every round beyond the first and
    the time a rank waits for relayed K/V (``relay_wait_seconds``)."""
    pieces = pack_pieces(np.array([2000]), 4, 500)
    config = PlannerConfig(0.0, block=50, token_bytes=TOKEN_BYTES, time_model=MODEL)
    plan = plan_tasks(pieces, config)
    loads, rounds = relay_plan_loads(plan, pieces, TOKEN_BYTES, fanout=1)
    assert rounds >= 2
    seconds, same_rounds = relay_rank_seconds(plan, pieces, config, fanout=1)
    assert same_rounds == rounds
    compute, exposed = loads_seconds(loads, MODEL, config.exposed_comm, plan.backward)
    sends = relay_kv_sends(kv_transfers(plan, pieces), fanout=1)
    wait = relay_wait_seconds(sends, TOKEN_BYTES.kv, MODEL.byte_seconds(1.0, plan.backward), 4)
    assert wait.max() > 0
    assert seconds.tolist() == pytest.approx((compute + exposed + (rounds - 1) * MODEL.collective_s + wait).tolist())


def test_a_chain_makes_its_last_server_wait_for_every_hop():
    """Holder 0 sends 10 K/V tokens to rank 1, which forwards them to rank 2 in round 2: rank 2's range
    arrives a hop later than its own link time, by one hop; the others never wait."""
    sends = RelaySends(np.array([0, 1]), np.array([1, 2]), np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.int64),
                       np.array([10, 10]), np.array([1, 2]))
    hop = 10 * 4 * 0.5  # tokens x kv bytes x seconds per byte
    assert relay_wait_seconds(sends, 4, 0.5, 3).tolist() == [0.0, 0.0, hop]
    direct = RelaySends(np.array([0, 0]), np.array([1, 2]), np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.int64),
                        np.array([10, 10]), np.array([1, 1]))
    assert relay_wait_seconds(direct, 4, 0.5, 3).tolist() == [0.0, 0.0, 0.0]


def test_relays_placed_by_time_unload_a_holder_that_bounds_the_layer():
    """Rank 0 holds an 800-token document whose eight 100-query shards run on ranks 0..7: direct, rank 0
    sends 200 + ... + 800 K/V tokens and bounds the layer; relays placed by time take most of that
    off it (servers that need the prefix forward it) and the predicted layer drops."""
    pieces = DocumentPieces.from_rank_lists([[(0, 0, 800)]] + [[] for _ in range(7)])
    k = np.arange(8)
    plan = Plan(source=np.zeros(8, dtype=np.int64), server=k, doc=np.zeros(8, dtype=np.int64), q_start=100 * k,
                q_end=100 * (k + 1), num_ranks=8, servers=tuple(range(8)))
    links = TimeModel(linear_s_per_token=0.0, attn_s_per_pair=1e-3, bytes_per_s=4.0, collective_s=7.0)
    config = PlannerConfig(0.0, token_bytes=TOKEN_BYTES, time_model=links)
    direct = kv_transfers(plan, pieces)
    before = rank_seconds(plan, pieces, config, direct)
    assert int(np.argmax(before)) == 0
    placed = relay_where_it_helps(plan, pieces, config, transfers=direct)
    _check_delivery(placed, direct, pieces, math.inf, 4)
    after, rounds = relay_step_seconds(plan, pieces, config, sends=placed)
    assert rounds >= 2 and after < 0.6 * before.max()
