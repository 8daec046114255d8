"""Attention variants, exact everywhere: sliding windows (Mistral, Qwen2 with windows, Gemma 2/3
local layers) and logit softcapping (Gemma 2).

HF's ``sliding_window = w``: the query at document position ``p`` sees the keys ``[p - w + 1, p]``.
Kernels are checked against explicit scores with a band mask per task (kernel_refs); CA-tasks whose K/V are cut
to the window (``[max(0, a - w + 1), b)`` for queries ``[a, b)``) against the uncut document; pair
counts and K/V bytes against brute-force counts.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernel_refs import cu_seqlens, random_qkv, reference_attention, weighted_grads
from distca_hf.kernels import varlen_attention_forward, varlen_causal_attention
from distca_hf.planning import causal_pairs, document_pairs, key_start, start_with_pairs

CPU_BACKENDS = ["torch_cpu", "math"]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shapes=st.lists(st.tuples(st.integers(1, 12), st.integers(0, 20)), min_size=1, max_size=5),
       window=st.integers(1, 24), heads=st.sampled_from([(4, 4), (4, 2), (6, 1)]))
def test_windowed_kernel_matches_band_mask(backend, shapes, window, heads, monkeypatch):
    """Forward and gradients of every CPU backend under a window, tasks with and without prefixes,
    windows shorter and longer than the tasks; small chunks so the torch_cpu band path is cut."""
    from distca_hf.kernels import torch_cpu

    monkeypatch.setattr(torch_cpu, "WINDOW_ROWS", 3)
    lq = [s[0] for s in shapes]
    lk = [s[0] + s[1] for s in shapes]
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    q, k, v = random_qkv(int(cu_q[-1]), int(cu_k[-1]), heads[0], heads[1], 8)
    out = varlen_causal_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), 0.4, backend, window=window)
    ref = reference_attention(q, k, v, cu_q, cu_k, 0.4, window)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    for got, want in zip(weighted_grads(out, (q, k, v)), weighted_grads(ref, (q, k, v))):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("window", [None, 5])
def test_softcapped_kernel_matches_reference(backend, window):
    """Softcapping (with and without a window): forward and gradients against explicit capped scores.
    torch_cpu cannot cap, so the call runs on math (with a one-time warning)."""
    shapes = [(6, 6), (3, 11), (1, 1), (9, 14)]
    cu_q, cu_k = cu_seqlens([a for a, _ in shapes]), cu_seqlens([b for _, b in shapes])
    q, k, v = random_qkv(int(cu_q[-1]), int(cu_k[-1]), 4, 2, 8)
    q_big = (q * 6).detach().requires_grad_()  # large scores, so the cap bends them
    out = varlen_causal_attention(q_big, k, v, cu_q, cu_k, 9, 14, 0.5, window=window, softcap=2.5,
                                  backend=None if backend == "torch_cpu" else backend)
    ref = reference_attention(q_big, k, v, cu_q, cu_k, 0.5, window, softcap=2.5)
    uncapped = reference_attention(q_big, k, v, cu_q, cu_k, 0.5, window)
    assert (ref - uncapped).abs().max() > 1e-2  # the cap matters in this case
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    for got, want in zip(weighted_grads(out, (q_big, k, v)), weighted_grads(ref, (q_big, k, v))):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


def test_softcap_on_a_backend_that_cannot_apply_it_is_refused_when_asked_for_by_name():
    q, k, v = random_qkv(4, 4, 2, 2, 8)
    with pytest.raises(ValueError, match="'torch_cpu' cannot apply softcap"):
        varlen_causal_attention(q, k, v, cu_seqlens([4]), cu_seqlens([4]), 4, 4, backend="torch_cpu", softcap=3.0)
    with pytest.raises(ValueError, match="softcap must be None or a finite number >= 0"):
        varlen_causal_attention(q, k, v, cu_seqlens([4]), cu_seqlens([4]), 4, 4, softcap=-1.0)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_windowed_cpu_kernel_low_precision(dtype, tol):
    cu_q, cu_k = cu_seqlens([40, 7, 30]), cu_seqlens([40, 50, 30])
    q, k, v = random_qkv(77, 120, 4, 2, 16, dtype)
    out, lse = varlen_attention_forward(q, k, v, cu_q, cu_k, 40, 50, None, "torch_cpu", window=9)
    ref = reference_attention(q.double(), k.double(), v.double(), cu_q, cu_k, 16**-0.5, 9)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    assert lse.dtype == torch.float32 and lse.shape == (4, 77)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@settings(max_examples=20, deadline=None)
@given(length=st.integers(1, 40), window=st.integers(1, 45), cuts=st.lists(st.integers(1, 39), max_size=4))
def test_window_trimmed_tasks_compose(backend, length, window, cuts):
    """A document cut into CA-tasks ``[a, b)`` whose keys are only ``[key_start(a, w), b)`` gives the
    whole document's windowed attention, values and gradients."""
    bounds = sorted({0, length, *(c for c in cuts if c < length)})
    q, k, v = random_qkv(length, length, 4, 2, 8)
    whole = varlen_causal_attention(q, k, v, cu_seqlens([length]), cu_seqlens([length]), length, length, 0.5, backend,
                                    window=window)
    starts, ends = bounds[:-1], bounds[1:]
    k_rows = torch.cat([torch.arange(key_start(a, window), b) for a, b in zip(starts, ends)])
    cu_k = cu_seqlens([b - key_start(a, window) for a, b in zip(starts, ends)])
    cut = varlen_causal_attention(q, k[k_rows], v[k_rows], cu_seqlens([b - a for a, b in zip(starts, ends)]), cu_k,
                                  length, length, 0.5, backend, window=window)
    torch.testing.assert_close(cut, whole, atol=1e-12, rtol=1e-10)
    for got, want in zip(weighted_grads(cut, (q, k, v)), weighted_grads(whole, (q, k, v))):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@settings(max_examples=15, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 20)), min_size=1, max_size=4),
       chunk=st.one_of(st.none(), st.integers(1, 9)), window=st.one_of(st.none(), st.integers(1, 12)),
       value_dim=st.sampled_from([8, 5, 12]))
def test_chunks_and_value_head_dims_match_explicit_scores(backend, shapes, chunk, window, value_dim):
    """Llama 4's chunked attention (a query at key column p sees keys [p // chunk * chunk, p]) and a
    value head dim other than q/k's (DeepSeek's MLA; fused kernels get it zero-padded), alone and
    together with a window, tasks with and without prefixes and without queries: forward and
    gradients against explicit scores with HF's chunk mask."""
    lq = [s[0] for s in shapes]
    lk = [s[0] + s[1] for s in shapes]
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    q, k, v = random_qkv(int(cu_q[-1]), int(cu_k[-1]), 4, 2, 8, value_dim=value_dim)
    out = varlen_causal_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), 0.4, backend, window=window, chunk=chunk)
    ref = reference_attention(q, k, v, cu_q, cu_k, 0.4, window, chunk=chunk)
    assert out.shape == (q.shape[0], 4, value_dim)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    for got, want in zip(weighted_grads(out, (q, k, v)), weighted_grads(ref, (q, k, v))):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


def test_chunks_change_the_answer_and_cut_tasks_at_chunk_boundaries():
    """The chunk mask matters (a reference without it differs) and ``chunk_tasks`` cuts a task with
    queries at key columns [3, 11) under chunk 4 into [3, 4) [4, 8) [8, 11) with keys from each
    chunk's start."""
    from distca_hf.kernels import chunk_tasks

    cu_q, cu_k = cu_seqlens([8, 2]), cu_seqlens([11, 2])
    q, k, v = random_qkv(10, 13, 4, 2, 8)
    chunked = varlen_causal_attention(q, k, v, cu_q, cu_k, 8, 11, 0.4, "math", chunk=4)
    assert (chunked - reference_attention(q, k, v, cu_q, cu_k, 0.4)).abs().max() > 1e-3
    cut = chunk_tasks(cu_q, cu_k, 4)
    assert cut.cu_seqlens_q.tolist() == [0, 1, 5, 8, 10]
    assert cut.cu_seqlens_k.tolist() == [0, 4, 8, 11, 13]
    assert cut.key_rows.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert chunk_tasks(cu_q, cu_k, 11) is None  # no key past the first chunk: nothing to cut
    with pytest.raises(ValueError, match="chunk must be None or a positive number of tokens"):
        varlen_causal_attention(q, k, v, cu_q, cu_k, 8, 11, chunk=0)


@pytest.mark.parametrize("window", [0, -3, 2.5, True, "8"])
def test_bad_window_is_refused(window):
    q, k, v = random_qkv(4, 4, 2, 2, 8)
    with pytest.raises(ValueError, match="window must be None or a positive number of keys"):
        varlen_causal_attention(q, k, v, cu_seqlens([4]), cu_seqlens([4]), 4, 4, window=window)


def test_windowed_pairs_of_arrays_beside_ints():
    """An int start with array ends (``document_pairs`` of an array) and tensors count like ints."""
    import numpy as np

    ends = np.array([5, 10, 100])
    assert document_pairs(ends, 8).tolist() == [document_pairs(int(n), 8) for n in ends] == [15, 52, 772]
    assert causal_pairs(3, ends, 4).tolist() == [causal_pairs(3, int(n), 4) for n in ends]
    assert causal_pairs(torch.tensor([0, 2]), torch.tensor([5, 9]), 3).tolist() == [12, 21]


@settings(max_examples=200, deadline=None)
@given(start=st.integers(0, 300), width=st.integers(0, 300), window=st.one_of(st.none(), st.integers(1, 400)))
def test_windowed_pairs_count_visible_keys(start, width, window):
    """``causal_pairs`` under a window is the brute-force count of visible keys, ``key_start`` the
    first key any of the queries sees, and ``start_with_pairs`` inverts ``causal_pairs``."""
    end = start + width
    seen = [(t + 1) if window is None else min(t + 1, window) for t in range(start, end)]
    assert causal_pairs(start, end, window) == sum(seen)
    if width:
        assert key_start(start, window) == (0 if window is None else max(0, start - window + 1))
        assert start_with_pairs(end, sum(seen), window) == pytest.approx(start, abs=1e-6)


# ---- pure planning: the K/V a windowed plan moves ----

@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=8), st.integers(1, 4), st.integers(1, 30), st.data())
def test_windowed_transfers_bring_every_key_a_task_sees(doc_lengths, world, window, data):
    """Documents over ``world`` ranks (spanning ranks): under a window, every server holds, from its own
    pieces and what it receives, the keys ``[key_start(a, w), b)`` of each task it runs, and the
    transfers are a subset of the unwindowed ones."""
    from distca_hf.planning import PlannerConfig, kv_transfers, plan_tasks, stitch_rank_documents
    from streams import draw_slices, keys_on_server

    per_rank, firsts = draw_slices(data, doc_lengths, world)
    pieces = stitch_rank_documents(per_rank, [0 * x for x in per_rank], firsts, span_ranks=True).pieces
    plan = plan_tasks(pieces, PlannerConfig(tolerance=0.0, block=1, window=window))
    unwindowed = type(plan)(plan.source, plan.server, plan.doc, plan.q_start, plan.q_end, plan.num_ranks,
                            plan.servers)
    windowed, whole = kv_transfers(plan, pieces), kv_transfers(unwindowed, pieces)
    for server, d, a, b in zip(plan.server, plan.doc, plan.q_start, plan.q_end):
        assert set(range(key_start(int(a), window), int(b))) <= keys_on_server(pieces, windowed, server, d)
    as_set = lambda t: {(int(s), int(v), int(d), x) for s, v, d, a, b in zip(t.source, t.server, t.doc, t.start, t.end)
                        for x in range(int(a), int(b))}
    assert as_set(windowed) <= as_set(whole)


# ---- models: exact against eager per document ----

def _window_models():
    from transformers import Gemma2Config, Gemma3TextConfig

    from helpers import tiny_config

    return {
        # every layer slides: the CA-tasks carry only the window's keys
        "mistral w5": tiny_config("mistral", sliding_window=5),
        # full and sliding layers: whole prefixes travel, each layer masks its own window
        "qwen2 mixed w6": tiny_config("qwen2", use_sliding_window=True, sliding_window=6, max_window_layers=1,
                                      num_hidden_layers=3),
        "gemma3 mixed w4": Gemma3TextConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                            sliding_window=4, layer_types=["sliding_attention", "full_attention",
                                                                           "sliding_attention"],
                                            max_position_embeddings=256),
        # softcapped logits and final logits, sliding and full layers
        "gemma2 softcap mixed w4": Gemma2Config(vocab_size=96, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                head_dim=8, sliding_window=4, attn_logit_softcapping=1.5,
                                                max_position_embeddings=256),
    }


@pytest.mark.parametrize("name", ["mistral w5", "qwen2 mixed w6", "gemma3 mixed w4", "gemma2 softcap mixed w4"])
def test_windowed_models_exact_against_each_document_alone(name):
    """Packed documents longer and shorter than the window, one process: logits and every parameter's
    gradient equal each document run alone with eager attention (HF's own sliding-window mask)."""
    from transformers import AutoModelForCausalLM

    from helpers import assert_grads_close, objective_weights, param_grads, per_document_reference

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_window_models()[name], attn_implementation="distca",
                                             dtype=torch.float32).train()
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, 96, (n,), generator=g) for n in (13, 3, 1, 21, 6)]
    weights = [objective_weights((len(d), 96), seed=i) for i, d in enumerate(docs)]
    ref_logits, ref_grads = per_document_reference(model, docs, weights)
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    logits = model(input_ids=ids, position_ids=pos).logits[0]
    (logits * torch.cat(weights)).sum().backward()
    torch.testing.assert_close(logits.detach(), torch.cat(ref_logits), atol=1e-5, rtol=1e-4)
    # fp32 rounding grows with the gradients' size (Gemma's scaled embeddings: up to ~65 here)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    assert_grads_close(param_grads(model), ref_grads, atol=1e-6 * max(scale, 10.0))


def test_widest_window_reads_the_config():
    from distca_hf.hf import widest_window

    models = _window_models()
    assert widest_window(models["mistral w5"]) == 5
    assert widest_window(models["qwen2 mixed w6"]) is None  # a full-attention layer needs whole prefixes
    assert widest_window(models["gemma3 mixed w4"]) is None
    from helpers import tiny_config

    assert widest_window(tiny_config("llama")) is None


def test_mixed_sliding_window_is_the_sliding_layers_window_of_mixed_models_only():
    """The window a mixed model's sliding layers are planned under on their own; ``None`` for models
    whose layers are all of one kind (every layer slides: one plan under the window) and for chunked
    attention beside full layers (Llama 4: its chunks are not a window)."""
    from transformers import Llama4TextConfig

    from distca_hf.hf import mixed_sliding_window
    from helpers import tiny_config

    models = _window_models()
    assert mixed_sliding_window(models["gemma3 mixed w4"]) == 4
    assert mixed_sliding_window(models["gemma2 softcap mixed w4"]) == 4
    assert mixed_sliding_window(models["qwen2 mixed w6"]) == 6
    assert mixed_sliding_window(models["mistral w5"]) is None
    assert mixed_sliding_window(tiny_config("llama")) is None
    assert mixed_sliding_window(tiny_config("qwen2", use_sliding_window=False, sliding_window=6)) is None
    chunked = Llama4TextConfig(num_hidden_layers=4, attention_chunk_size=8, no_rope_layers=[1, 1, 1, 0])
    assert "chunked_attention" in chunked.layer_types and mixed_sliding_window(chunked) is None


# ---- several ranks: windows shorter than documents that span ranks ----

WINDOW_CASES = {
    # name: (world, family, model overrides, document lengths, slice lengths per rank, checkpointing)
    "mistral w7, documents over both ranks": (2, "mistral", {"sliding_window": 7}, [30, 50, 7, 1, 12], [60, 40],
                                              (False,)),
    "qwen2 mixed w9, one document over three ranks": (
        3, "qwen2", {"use_sliding_window": True, "sliding_window": 9, "max_window_layers": 1, "num_hidden_layers": 3},
        [9, 100, 5], [40, 40, 34], (False, True)),
}


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_windowed_spanning_documents_are_exact(tmp_path, case):
    """Every overlap mode and both backward modes, exact against each whole document alone; a
    uniformly windowed model moves fewer K/V tokens than its unwindowed plan would, and a mixed model's
    sliding layers run a plan of their own that moves only their window's keys (checkpointed layers
    recomputed in the plan of their kind)."""
    from dist_harness import run_ranks
    from workers import check_forward_bytes, exact_runs, span_worker

    world, family, overrides, doc_lengths, slice_lengths, checkpointing = WINDOW_CASES[case]
    results = run_ranks(span_worker, world, tmp_path, family, doc_lengths, slice_lengths,
                        ("none", "wave", "pingpong"), overrides, checkpointing, env={"DISTCA_TOLERANCE": "0.02"})
    for rank, runs in exact_runs(results, 6 * len(checkpointing) + 1):
        for run in runs:
            assert run["stats"]["dispatched"]
            # ping-pong's nano-batches too: planned for each kind of layer
            assert ("sliding_layers" in run["stats"]) == case.startswith("qwen2"), run
            if case.startswith("qwen2"):  # the sliding layers' tasks need the 8 keys before them, not prefixes
                sliding = run["stats"]["sliding_layers"]["9"]
                assert sum(sliding["kv_tokens_received_per_layer"]) < sum(run["stats"]["kv_tokens_received_per_layer"])
    # what the ranks sent is what the plans say: a mixed Qwen2's layers 1 and 2 slide, on their own plan
    mixed = case.startswith("qwen2")
    check_forward_bytes(results, layers=3 if mixed else 2, sliding=2 if mixed else 0)
    colocated = results[0]["value"][-2]["stats"]
    if case.startswith("mistral"):  # pairs are counted under the window (at most 7 per query)
        lengths = [30, 50, 7, 1, 12]
        assert sum(colocated["attn_pairs_local"]) == sum(sum(min(t + 1, 7) for t in range(n)) for n in lengths)
        assert sum(colocated["attn_pairs_served"]) == sum(colocated["attn_pairs_local"])
        # colocated: only rank 1's piece [30, 50) of document 1 needs keys from rank 0, and under the
        # window only [key_start(30, 7), 30) = [24, 30): 6 tokens, not the whole 30-token prefix
        assert sum(colocated["kv_tokens_received_per_layer"]) == 6
    else:  # the full-attention layer: whole prefixes travel (document 1 from token 31 on rank 1, 71 on rank 2)
        assert sum(colocated["kv_tokens_received_per_layer"]) == 31 + 71
        # its sliding layers: the 8 keys before each continuing piece, [23, 31) and [63, 71)
        sliding = colocated["sliding_layers"]["9"]
        assert sum(sliding["kv_tokens_received_per_layer"]) == 8 + 8
        assert sum(sliding["attn_pairs_local"]) == sum(sum(min(t + 1, 9) for t in range(n)) for n in doc_lengths)
