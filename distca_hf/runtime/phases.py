"""The phases of one wave of a dispatch, forward and backward, as plain functions. A schedule
(``wave_schedule``: overlap ``none`` and ``wave``; ``pingpong``) decides what overlaps what.

Forward: ``launch_inputs`` (source: q/k/v rows to servers) -> ``serve_forward`` (server: one fused
kernel call) -> ``launch_outputs`` (server: outputs back) -> ``place_outputs`` (source). Backward:
``launch_grad_inputs`` (source: dO, or in ``resend`` mode q, k, v, out, dO and log-sum-exp) ->
``serve_backward`` -> ``launch_grad_outputs`` (server: dQ/dK/dV back) -> ``place_grads`` (source).

Relayed K/V (``Wave.relays``, ``planning.relay_trees``): the pools grow by each relay round's rows
inside ``serve_forward`` (``relay_kv``, after the first round arrived) and, in ``resend`` mode, inside
``serve_backward`` again; ``serve_backward`` sends each round's K/V gradients back up its trees
(``relay_kv_grads``) before returning the pools' gradients, so the first round's return as without
relays. Every rank enters every round (the plan's deepest tree), sending nothing if it has nothing.
Both serve functions call a schedule's ``pools_ready`` hook between the relay rounds and the kernel,
where the schedule's ``issue_queue.IssueQueue`` issues the exchanges it held, so that the rounds
before the kernel do not queue behind them.

Key-split plans (``Wave.merges``): a server returns each row's partial output and log-sum-exp (its
tasks of a row merged first), the source merges every partial of a row (``merge_outputs``), and
backward sends dO with the merged output and log-sum-exp (``saved``: the server kept q/k/v only;
``resend``: the source's resent out and lse are the merged ones); dQ partials of a row are summed.

Shapes: local q ``[tokens, heads, head_dim]``, k ``[tokens, kv_heads, head_dim]``, v ``[tokens,
kv_heads, value_head_dim]`` (DeepSeek's MLA: another head dim than q/k), out ``[tokens, heads,
value_head_dim]``; padding tokens belong to no task and get zero output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UnsupportedAttentionError
from ..kernels import (AttentionVariant, accumulation_dtype, merge_rows, varlen_attention_backward,
                       varlen_attention_forward)
from . import timeline
from .exchange import Pending, split_rows, start_exchange
from .tables import Wave

__all__ = ["Served", "launch_inputs", "serve_forward", "launch_outputs", "place_outputs", "merge_outputs",
           "launch_grad_inputs", "relay_kv", "relay_kv_grads",
           "receive_all", "serve_backward", "launch_grad_outputs", "place_grads", "kept_bytes"]


def launch_inputs(w: Wave, q, k, v) -> Pending:
    """Forward, source side: send the query rows and K/V rows of moved tasks to their servers."""
    qs = split_rows(q.index_select(0, w.send_q_rows), w.send_q_counts)
    ks = split_rows(k.index_select(0, w.send_kv_rows), w.send_kv_counts)
    vs = split_rows(v.index_select(0, w.send_kv_rows), w.send_kv_counts)
    return start_exchange(w, [[a, b, c] for a, b, c in zip(qs, ks, vs)],
                           [w.recv_q_counts, w.recv_kv_counts, w.recv_kv_counts],
                           [tuple(q.shape[1:]), tuple(k.shape[1:]), tuple(v.shape[1:])],
                           "distca forward: sending q/k/v to servers", "forward_inputs")


@dataclass(eq=False)
class Served:
    """A wave's forward on its server: ``out_pool`` / ``lse_pool`` rows follow the query pool
    (``[local rows] ++ [received rows]``; rows of no task of this wave are zero), and the fused
    tensors its backward needs in ``saved`` mode."""

    out_pool: torch.Tensor
    lse_pool: torch.Tensor | None
    fq: torch.Tensor
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    f_out: torch.Tensor
    f_lse: torch.Tensor


def check_layer_window(w: Wave, window: int | None, chunk: int | None = None) -> None:
    """A layer may run a sliding window up to the one the wave's K/V were cut to, never wider (its
    queries would miss keys the plan did not bring). Key-split tasks were cut for the plan's window
    exactly (a full tile is inside every query's window), and not into attention chunks."""
    if w.kv_window is not None and (window is None or window > w.kv_window):
        raise UnsupportedAttentionError(
            f"distca forward {w.forward_number}: a layer asks for sliding_window={window} but this forward's CA-tasks "
            f"carry only the last {w.kv_window} keys of each query (the widest window found in the model's config); "
            "set config.sliding_window / config.layer_types to what the layers use")
    if getattr(w, "merges", False) and (window != w.kv_window or chunk):
        raise UnsupportedAttentionError(
            f"distca forward {w.forward_number}: this forward's plan splits CA-tasks along keys for "
            f"sliding_window={w.kv_window}, but a layer runs sliding_window={window}"
            f"{f' with attention_chunk_size={chunk}' if chunk else ''}; key-split tiles hold exactly for the plan's "
            "window and without attention chunks: plan without key splits for models that mix them")


def _fused_rows(pool: torch.Tensor, index: torch.Tensor, identity: bool) -> torch.Tensor:
    """The rows ``index`` of ``pool`` in the fused batch's order; the pool itself when the wave's index
    picks every row once, in order (``Wave.q_identity`` / ``k_identity``: no gather)."""
    return pool if identity else pool.index_select(0, index)


def relay_kv(w: Wave, k_pool: torch.Tensor, v_pool: torch.Tensor, what: str = "forward"):
    """The relay rounds of a wave (``Wave.relays``): each round sends rows of this rank's K/V pools to
    the next servers of their trees and appends what arrives (``[pool rows + the rounds' rows,
    kv_heads, head_dim]``). ``what``: ``"forward"``, or ``"backward"`` (``resend`` mode relays again)."""
    shapes = [tuple(k_pool.shape[1:]), tuple(v_pool.shape[1:])]
    for number, relay in enumerate(w.relays, start=2):
        parts = [list(p) for p in zip(split_rows(k_pool.index_select(0, relay.send_rows), relay.send_counts),
                                      split_rows(v_pool.index_select(0, relay.send_rows), relay.send_counts))]
        got_k, got_v = start_exchange(w, parts, [relay.recv_counts, relay.recv_counts], shapes,
                                      f"distca {what}: relaying K/V, round {number}", f"{what}_relay_kv").wait()
        k_pool, v_pool = torch.cat([k_pool, got_k]), torch.cat([v_pool, got_v])
    return k_pool, v_pool


def relay_kv_grads(w: Wave, dk_pool: torch.Tensor, dv_pool: torch.Tensor):
    """Backward of ``relay_kv``: the last round first, each round's rows' K/V gradients go back to the
    rank that forwarded them, which adds them to the rows it forwarded (so a row's gradient sums every
    server of its subtree before it goes up). Returns the pools' gradients without the relayed rows:
    ``[local rows + the first round's rows, ...]``."""
    end = dk_pool.shape[0]
    shapes = [tuple(dk_pool.shape[1:]), tuple(dv_pool.shape[1:])]
    for number, relay in reversed(list(enumerate(w.relays, start=2))):
        begin = end - sum(relay.recv_counts)
        parts = [list(p) for p in zip(split_rows(dk_pool[begin:end], relay.recv_counts),
                                      split_rows(dv_pool[begin:end], relay.recv_counts))]
        got_dk, got_dv = start_exchange(w, parts, [relay.send_counts, relay.send_counts], shapes,
                                        f"distca backward: returning relayed K/V gradients, round {number}",
                                        "backward_relay_grads").wait()
        dk_pool, dv_pool = dk_pool[:begin], dv_pool[:begin]
        dk_pool.index_add_(0, relay.send_rows, got_dk)
        dv_pool.index_add_(0, relay.send_rows, got_dv)
        end = begin
    return dk_pool, dv_pool


def serve_forward(w: Wave, q, k, v, received, scale: float, want_lse: bool,
                  variant: AttentionVariant = AttentionVariant(), *, pools_ready=None) -> Served:
    """Forward, server side: run the wave's CA-tasks as one fused varlen batch (under the layer's
    sliding window and softcap, ``variant``). ``pools_ready``: called once the pools are complete
    (after the relay rounds of a wave that receives), before the kernel."""
    check_layer_window(w, variant.window, variant.chunk)
    served = w.served
    if received is None:
        q_pool, k_pool, v_pool = q, k, v
    else:
        q_pool, k_pool, v_pool = (torch.cat([a, b]) for a, b in zip((q, k, v), received))
        k_pool, v_pool = relay_kv(w, k_pool, v_pool)
    if pools_ready is not None:
        pools_ready()
    fq = _fused_rows(q_pool, served.q_index, w.q_identity)
    fk, fv = (_fused_rows(pool, served.k_index, w.k_identity) for pool in (k_pool, v_pool))
    heads, value_dim = q.shape[1], v.shape[-1]
    if w.num_tasks:
        with timeline.span(f"attention kernel ({w.name})"):
            f_out, f_lse = varlen_attention_forward(fq, fk, fv, served.cu_seqlens_q, served.cu_seqlens_k,
                                                    served.max_seqlen_q, served.max_seqlen_k, scale,
                                                    window=variant.window, softcap=variant.softcap,
                                                    chunk=variant.chunk, full=served.full,
                                                    causal_rows=served.causal_rows)
    else:
        # (a server of no task: its empty log-sum-exp in the kernels' dtype, as every rank's lse exchange expects)
        f_out, f_lse = fq.new_empty(0, heads, value_dim), torch.empty(heads, 0, dtype=accumulation_dtype(q.dtype),
                                                                      device=q.device)
    if w.merges:  # several tasks of a row: their partials merged here (a row of no task: 0 and -inf)
        out_pool, lse_pool = merge_rows(served.q_index, f_out, f_lse.t(), q_pool.shape[0])
        return Served(out_pool, lse_pool, fq, k_pool, v_pool, f_out, f_lse)
    if w.q_identity:  # the fused rows are the pool's
        out_pool, lse_pool = f_out, f_lse.t().contiguous() if want_lse else None
        return Served(out_pool, lse_pool, fq, k_pool, v_pool, f_out, f_lse)
    # in place: index_copy (out of place) would copy the zeroed pool once more
    out_pool = q_pool.new_zeros(q_pool.shape[0], heads, value_dim).index_copy_(0, served.q_index, f_out)
    lse_pool = None
    if want_lse:
        lse_pool = torch.zeros(q_pool.shape[0], heads, dtype=f_lse.dtype, device=q.device)
        lse_pool.index_copy_(0, served.q_index, f_lse.t())
    return Served(out_pool, lse_pool, fq, k_pool, v_pool, f_out, f_lse)


def launch_outputs(w: Wave, served: Served) -> list[Pending]:
    """Forward, server side: return the outputs (and in ``resend`` mode, in a second exchange
    because it stays fp32, the log-sum-exp) of other sources' tasks."""
    n = w.num_local
    pending = [start_exchange(w, [[o] for o in split_rows(served.out_pool[n:], w.recv_q_counts)], [w.send_q_counts],
                               [tuple(served.out_pool.shape[1:])], "distca forward: returning outputs",
                               "forward_outputs")]
    if served.lse_pool is not None:
        pending.append(start_exchange(w, [[x] for x in split_rows(served.lse_pool[n:], w.recv_q_counts)],
                                       [w.send_q_counts], [tuple(served.lse_pool.shape[1:])],
                                       "distca forward: returning log-sum-exp", "forward_lse"))
    return pending


def place_outputs(w: Wave, pending: list[Pending], out: torch.Tensor, lse: torch.Tensor | None):
    """Forward, source side: put the returned outputs (and log-sum-exp) in their rows, in place."""
    out.index_copy_(0, w.send_q_rows, pending[0].wait()[0])
    if lse is not None:
        lse.index_copy_(0, w.send_q_rows, pending[1].wait()[0])


def merge_outputs(waves_partials, num_local: int):
    """Forward, source side, key-split plans: every partial of this rank's rows, ``(rows, out, lse)``
    per wave (its local pool's rows, and each returned exchange's ``send_q_rows``), merged by
    log-sum-exp into ``(out [num_local, heads, value_dim], lse [num_local, heads])``."""
    rows, outs, lses = zip(*waves_partials)
    return merge_rows(torch.cat(rows), torch.cat(outs), torch.cat(lses), num_local)


def returned_partials(w: Wave, pending: list[Pending]):
    """The ``(rows, out, lse)`` partials a wave's servers returned to this rank (key-split plans)."""
    return w.send_q_rows, pending[0].wait()[0], pending[1].wait()[0]


def launch_grad_inputs(w: Wave, dout, resend: tuple | None, merged: tuple | None = None) -> list[Pending]:
    """Backward, source side: send dO of moved queries (``resend``: also q, k, v, out, and the fp32
    log-sum-exp in a second exchange, from the tuple ``(q, k, v, out, lse)`` of local rows; in
    ``saved`` mode of a key-split plan, ``merged``: the rows' merged ``(out, lse)``, sent with dO)."""
    rows = lambda t: split_rows(t.index_select(0, w.send_q_rows), w.send_q_counts)
    oshape = tuple(dout.shape[1:])  # dO and out: the value head dim
    if resend is None and merged is not None:
        out, lse = merged
        return [start_exchange(w, [list(p) for p in zip(rows(dout), rows(out))], [w.recv_q_counts, w.recv_q_counts],
                               [oshape, oshape], "distca backward: sending dO and merged outputs", "backward_inputs"),
                start_exchange(w, [[x] for x in rows(lse)], [w.recv_q_counts], [(lse.shape[1],)],
                               "distca backward: sending merged log-sum-exp", "backward_lse")]
    if resend is None:
        return [start_exchange(w, [[x] for x in rows(dout)], [w.recv_q_counts], [oshape],
                                "distca backward: sending dO to servers", "backward_inputs")]
    q, k, v, out, lse = resend
    krows = lambda t: split_rows(t.index_select(0, w.send_kv_rows), w.send_kv_counts)
    qshape, kshape, vshape = tuple(q.shape[1:]), tuple(k.shape[1:]), tuple(v.shape[1:])
    sends = [list(p) for p in zip(rows(q), krows(k), krows(v), rows(out), rows(dout))]
    return [
        start_exchange(w, sends, [w.recv_q_counts, w.recv_kv_counts, w.recv_kv_counts, w.recv_q_counts,
                                   w.recv_q_counts], [qshape, kshape, vshape, oshape, oshape],
                        "distca backward: resending q/k/v/out/dO", "backward_inputs"),
        start_exchange(w, [[x] for x in rows(lse)], [w.recv_q_counts], [(lse.shape[1],)],
                        "distca backward: resending log-sum-exp", "backward_lse"),
    ]


def receive_all(pending: list[Pending]) -> list[torch.Tensor]:
    return [t for p in pending for t in p.wait()]


def serve_backward(w: Wave, dout, received, saved, scale: float, variant: AttentionVariant = AttentionVariant(),
                   merged: tuple | None = None, *, pools_ready=None):
    """Backward, server side: the wave's fused backward. ``saved`` is ``(fq, k_pool, v_pool, f_out,
    f_lse)`` (``saved`` mode) or the source's ``(q, k, v, out, lse)`` (``resend`` mode, whose
    ``received`` then holds the other sources' q, k, v, out, dO, lse rows). ``received`` is empty for
    a local wave. Key-split plans in ``saved`` mode: ``merged`` is this rank's rows' merged ``(out,
    lse)`` and ``received`` the other sources' dO, out, lse rows (``saved``'s f_out / f_lse, partial,
    are not used). ``pools_ready``: called before the kernel (after the relay rounds of ``resend``
    mode). Returns the gradient pools ``(dq_pool, dk_pool, dv_pool)``, local rows first."""
    served = w.served
    if w.backward_mode == "saved" and w.merges:
        fq, k_pool, v_pool = saved[:3]
        out, lse = merged
        if received:
            rdo, ro, rlse = received
            dout, out, lse = torch.cat([dout, rdo]), torch.cat([out, ro]), torch.cat([lse, rlse])
        f_do, f_out = dout.index_select(0, served.q_index), out.index_select(0, served.q_index)
        f_lse = lse.index_select(0, served.q_index).t().contiguous()
        pool_rows = w.num_local + sum(w.recv_q_counts)
    elif w.backward_mode == "saved":
        fq, k_pool, v_pool, f_out, f_lse = saved
        f_do = _fused_rows(torch.cat([dout, received[0]]) if received else dout, served.q_index, w.q_identity)
        pool_rows = w.num_local + sum(w.recv_q_counts)
    else:
        q, k, v, out, lse = saved
        if received:
            rq, rk, rv, ro, rdo, rlse = received
            q, k, v, out, dout, lse = (torch.cat(p) for p in ((q, rq), (k, rk), (v, rv), (out, ro), (dout, rdo),
                                                             (lse, rlse)))
        k_pool, v_pool = relay_kv(w, k, v, "backward") if received else (k, v)
        fq, f_out, f_do, f_lse = (_fused_rows(t, served.q_index, w.q_identity) for t in (q, out, dout, lse))
        f_lse = f_lse.t().contiguous()
        pool_rows = q.shape[0]
    if pools_ready is not None:
        pools_ready()
    qshape = tuple(fq.shape[1:])
    fk, fv = (_fused_rows(pool, served.k_index, w.k_identity) for pool in (k_pool, v_pool))
    if w.num_tasks:
        with timeline.span(f"attention kernel backward ({w.name})"):
            fdq, fdk, fdv = varlen_attention_backward(f_do, fq, fk, fv, f_out, f_lse, served.cu_seqlens_q,
                                                      served.cu_seqlens_k, served.max_seqlen_q,
                                                      served.max_seqlen_k, scale, window=variant.window,
                                                      softcap=variant.softcap, chunk=variant.chunk, full=served.full,
                                                      causal_rows=served.causal_rows)
    else:
        fdq, fdk, fdv = fq, fk, fv  # empty
    # a key-split plan's tasks of one row each give a dQ partial: summed (in place: index_add, out of
    # place, would copy each zeroed pool once more)
    if w.q_identity and fdq.dtype == fq.dtype:  # the fused rows are the pool's, each once
        dq_pool = fdq
    else:
        dq_pool = fq.new_zeros(pool_rows, *qshape).index_add_(0, served.q_index, fdq)
    if w.k_identity and fdk.dtype == fk.dtype and fdv.dtype == fv.dtype:
        dk_pool, dv_pool = fdk, fdv
    else:
        dk_pool = fk.new_zeros(k_pool.shape).index_add_(0, served.k_index, fdk)
        dv_pool = fv.new_zeros(v_pool.shape).index_add_(0, served.k_index, fdv)
    dk_pool, dv_pool = relay_kv_grads(w, dk_pool, dv_pool)  # (no relay rounds: the pools as they are)
    return dq_pool, dk_pool, dv_pool


def launch_grad_outputs(w: Wave, pools) -> Pending:
    """Backward, server side: return dQ, dK, dV of other sources' rows."""
    dq_pool, dk_pool, dv_pool = pools
    n, nk = w.num_local, w.num_local_kv
    back = [list(p) for p in zip(split_rows(dq_pool[n:], w.recv_q_counts), split_rows(dk_pool[nk:], w.recv_kv_counts),
                                 split_rows(dv_pool[nk:], w.recv_kv_counts))]
    shapes = [tuple(dq_pool.shape[1:]), tuple(dk_pool.shape[1:]), tuple(dv_pool.shape[1:])]
    return start_exchange(w, back, [w.send_q_counts, w.send_kv_counts, w.send_kv_counts], shapes,
                           "distca backward: returning dQ/dK/dV", "backward_outputs")


def place_grads(w: Wave, pending: Pending, dq, dk, dv) -> None:
    """Backward, source side: add the returned gradients to their rows, in place (a K/V token used
    on several servers gets the sum)."""
    got_dq, got_dk, got_dv = pending.wait()
    dq.index_add_(0, w.send_q_rows, got_dq)
    dk.index_add_(0, w.send_kv_rows, got_dk)
    dv.index_add_(0, w.send_kv_rows, got_dv)


def kept_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
