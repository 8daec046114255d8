"""The schedule of overlap ``none`` and ``wave``: every wave of a dispatch inside one autograd node.

Remote waves' inputs are launched first, then the waves run in order (their outputs launched back
as soon as computed) and the returns are placed at the end; backward does the mirror image, waves in
reverse order. With one wave (``none``) each exchange is waited on right after its launch. Where a
wave's K/V is relayed before its kernel (forward; ``resend`` mode's backward), the other waves'
exchanges are held until its relay rounds are issued (``issue_queue.IssueQueue``).
"""

from __future__ import annotations

import torch

from ..kernels import AttentionVariant, accumulation_dtype

from .dispatch import Dispatch
from .issue_queue import IssueQueue
from .phases import (kept_bytes, launch_grad_inputs, launch_grad_outputs, launch_inputs, launch_outputs,
                     merge_outputs, place_grads, place_outputs, receive_all, returned_partials, serve_backward,
                     serve_forward)

__all__ = ["dispatched_attention"]


class _WaveSchedule(torch.autograd.Function):
    """Every wave of a dispatch inside one autograd node: remote waves' inputs are launched first,
    then the waves run in order (their outputs launched back as soon as computed) and the returns
    are placed at the end. Backward does the mirror image, waves in reverse order. Exchanges asked
    for while a wave's relay rounds are pending go out once they are (``IssueQueue``)."""

    @staticmethod
    def forward(ctx, q, k, v, dispatch: Dispatch, scale: float, variant: AttentionVariant):
        waves = dispatch.waves
        resend, merges = waves[0].backward_mode == "resend", waves[0].merges
        if dispatch.backward is not None and not resend:
            raise ValueError("distca: a dispatch whose backward is planned apart needs backward='resend'")
        queue = IssueQueue()  # relay rounds run before the kernels: other waves' exchanges wait for them
        for i, w in enumerate(waves):
            if not w.local_only:
                queue.issue(("inputs", i), lambda w=w: launch_inputs(w, q, k, v), opens_relays_of=w if w.relays else None)
        out = q.new_zeros(*q.shape[:2], v.shape[-1])  # v's head dim (DeepSeek's MLA: not q's)
        lse = torch.zeros(q.shape[0], q.shape[1], dtype=accumulation_dtype(q.dtype), device=q.device) if resend else None
        kept, partials = [], []
        for i, w in enumerate(waves):
            received = None if w.local_only else queue.take(("inputs", i)).wait()
            served = serve_forward(w, q, k, v, received, scale, want_lse=resend, variant=variant,
                                   pools_ready=lambda w=w: queue.relays_issued(w))
            if merges:  # a row's partials of every wave and server are merged at the end
                partials.append((torch.arange(w.num_local, device=q.device), served.out_pool[: w.num_local],
                                 served.lse_pool[: w.num_local]))
            else:
                out += served.out_pool[: w.num_local]  # rows of other waves' tasks are zero here
                if resend:
                    lse += served.lse_pool[: w.num_local]
            if not w.local_only:
                queue.issue(("return", i), lambda w=w, served=served: launch_outputs(w, served))
            if not resend:
                pools = _kept_kv(w, served, received) if dispatch.keeps_kv_once else (served.k_pool, served.v_pool)
                kept.append((served.fq, *pools) if merges else (served.fq, *pools, served.f_out, served.f_lse))
        returning = [(w, queue.take(("return", i))) for i, w in enumerate(waves) if not w.local_only]
        if merges:
            out, lse = merge_outputs(partials + [returned_partials(w, pending) for w, pending in returning], q.shape[0])
        else:
            for w, pending in returning:
                place_outputs(w, pending, out, lse)
        ctx.dispatch, ctx.scale, ctx.variant, ctx.q_shape = dispatch, scale, variant, q.shape
        if dispatch.keeps_kv_once:  # the local K/V, once: every wave's pool starts with it
            kept.append((k, v))
        if merges and not resend:  # backward runs every task with the rows' merged out and lse
            kept.append((out, lse))
        flat = [t for group in kept for t in group] if not resend else [q, k, v, out, lse]
        ctx.save_for_backward(*flat)
        if any(ctx.needs_input_grad[:3]):  # nothing is kept under no_grad
            # the local K/V pools of saved mode are the inputs themselves: count them once
            dispatch.counters.saved_bytes += kept_bytes({id(t): t for t in flat}.values())
        return out

    @staticmethod
    def backward(ctx, dout):
        dispatch, scale = ctx.dispatch.backward or ctx.dispatch, ctx.scale
        waves = dispatch.waves
        dout = dout.contiguous()
        saved = ctx.saved_tensors
        resend = waves[0].backward_mode == "resend"
        merged = tuple(saved[-2:]) if ctx.dispatch.waves[0].merges and not resend else None
        width = 3 if merged is not None else 5  # tensors kept per wave in saved mode
        per_wave = (lambda i: saved) if resend else (lambda i: saved[width * i : width * i + width])
        if ctx.dispatch.keeps_kv_once:
            per_wave = _pools_rebuilt(ctx.dispatch.waves, saved, width, tail=2 if merged is not None else 0)
        order = list(reversed(range(len(waves))))
        resent = saved if resend else None
        queue = IssueQueue()  # resend mode relays before its kernels (saved mode only the gradients, after)
        for i in order:
            if not waves[i].local_only:
                queue.issue(("inputs", i), lambda w=waves[i]: launch_grad_inputs(w, dout, resent, merged),
                            opens_relays_of=waves[i] if resend and waves[i].relays else None)
        dq = dout.new_zeros(ctx.q_shape)
        dk = saved[1].new_zeros(waves[0].num_local_kv, *saved[1].shape[1:])  # saved[1]: k or a K/V pool
        dv = saved[2].new_zeros(waves[0].num_local_kv, *saved[2].shape[1:])  # saved[2]: v or a V pool
        for i in order:
            w = waves[i]
            received = [] if w.local_only else receive_all(queue.take(("inputs", i)))
            pools = serve_backward(w, dout, received, per_wave(i), scale, ctx.variant, merged,
                                   pools_ready=lambda w=w: queue.relays_issued(w))
            dq += pools[0][: w.num_local]
            dk += pools[1][: w.num_local_kv]
            dv += pools[2][: w.num_local_kv]
            if not w.local_only:
                queue.issue(("return", i), lambda w=w, pools=pools: launch_grad_outputs(w, pools))
        for i in order:
            if not waves[i].local_only:
                place_grads(waves[i], queue.take(("return", i)), dq, dk, dv)
        return dq, dk, dv, None, None, None


def _kept_kv(w, served, received):
    """``(k rows, v rows)`` a wave keeps for backward when its dispatch keeps K/V once
    (``Dispatch.keeps_kv_once``): the received rows (every relay round's too) no earlier wave brought
    (``Wave.keep_kv_rows``); none when it receives no K/V (its pool is the local rows, kept once for
    every wave). Never a view of the pool, which holds a copy of the local rows."""
    if w.kv_store_rows is None:
        return served.k_pool[:0], served.v_pool[:0]
    if not w.relays:  # the first round's rows: the received tensors themselves
        k_received, v_received = received[1], received[2]
    else:  # the relay rounds' rows are only in the pool
        k_received, v_received = served.k_pool[w.num_local_kv:], served.v_pool[w.num_local_kv:]
        if w.keep_kv_rows is None:
            return k_received.clone(), v_received.clone()
    if w.keep_kv_rows is None:
        return k_received, v_received
    return k_received.index_select(0, w.keep_kv_rows), v_received.index_select(0, w.keep_kv_rows)


def _pools_rebuilt(waves, saved, width: int, tail: int):
    """``per_wave`` of a backward whose forward kept K/V once (``_kept_kv``): each wave's saved
    tensors with its K/V pools rebuilt from the store ``[local rows] ++ [every wave's kept rows]``
    (``Wave.kv_store_rows``). ``saved``: ``width`` tensors per wave, the local k and v, then ``tail``
    more. The store lives for this backward only (one layer's transient, as the pools were)."""
    k, v = saved[len(saved) - tail - 2], saved[len(saved) - tail - 1]
    stores = [torch.cat([local] + [saved[width * i + j] for i in range(len(waves))]) for j, local in ((1, k), (2, v))]

    def per_wave(i):
        group = saved[width * i : width * i + width]
        rows = waves[i].kv_store_rows
        pools = (k, v) if rows is None else tuple(store.index_select(0, rows) for store in stores)
        return (group[0], *pools, *group[3:])

    return per_wave


def dispatched_attention(q, k, v, dispatch: Dispatch, scale: float, *,
                         variant: AttentionVariant = AttentionVariant()) -> torch.Tensor:
    """Causal attention of the rank's documents (under the layer's sliding window and softcap,
    ``variant``), computed where the plan says. q ``[tokens, heads, head_dim]``, k ``[tokens,
    kv_heads, head_dim]``, v ``[tokens, kv_heads, value_head_dim]`` -> ``[tokens, heads,
    value_head_dim]``."""
    return _WaveSchedule.apply(q, k, v, dispatch, scale, variant)
