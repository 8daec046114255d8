"""Rank functions and checks shared by several test files (run on spawned gloo ranks through
``dist_harness.run_ranks``; they import what they need inside, in the child process)."""

from __future__ import annotations

import torch

SKEWED = {  # per step, per rank: document lengths (one long, many short and odd, a single token)
    0: [[200], [3, 5, 7, 1, 9, 11, 2, 13, 4, 6], [1], [17, 9, 1, 33]],
    1: [[5, 1, 3], [151, 2], [7, 7, 7], [1]],
}


def documents_for(rank, world, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    lengths = SKEWED[step][rank] if world > 2 else (SKEWED[step][rank] + SKEWED[step][rank + 2])
    return [torch.randint(0, 96, (n,), generator=g) for n in lengths]


def exactness_worker(rank, world, family, overlap="none"):
    """Logits and parameter gradients against each document alone, both backward modes, with and
    without checkpointing, two different batches, then evaluation; ``plan_stats`` of every run."""
    import distca_hf
    from helpers import (checkpointing_disable, checkpointing_enable, objective_weights, param_grads,
                         per_document_reference, tiny_model)

    model = tiny_model(family)
    report = []
    for backward in ("saved", "resend"):
        for checkpointing in (False, True):
            # unbounded memory: each run checks the backward mode it configured (the budget may pick resend)
            distca_hf.configure(backward=backward, overlap=overlap, memory_budget=None)
            if checkpointing:
                checkpointing_enable(model, use_reentrant=False)
            else:
                checkpointing_disable(model)
            for step in (0, 1):
                docs = documents_for(rank, world, step)
                weights = [objective_weights((len(d), 96), seed=7 * step + i) for i, d in enumerate(docs)]
                ref_logits, ref_grads = per_document_reference(model, docs, weights)
                model.zero_grad(set_to_none=True)
                ids = torch.cat(docs).unsqueeze(0)
                pos = torch.cat([torch.arange(len(d)) for d in docs]).unsqueeze(0)
                logits = model(input_ids=ids, position_ids=pos).logits[0]
                (logits * torch.cat(weights)).sum().backward()
                grads = param_grads(model)
                # like torch.testing: |got - want| <= atol + rtol |want|, reported as the worst excess
                grad_err = max(float(((grads[n] - ref_grads[n]).abs() - 1e-4 * ref_grads[n].abs()).max())
                               for n in ref_grads)
                stats = distca_hf.plan_stats()
                report.append({
                    "backward": backward, "checkpointing": checkpointing, "step": step,
                    "logit_err": float((logits.detach() - torch.cat(ref_logits)).abs().max()),
                    "grad_excess": grad_err, "same_grad_keys": sorted(grads) == sorted(ref_grads),
                    "stats": stats,
                })
    with torch.no_grad():  # evaluation
        docs = documents_for(rank, world, 0)
        ids = torch.cat(docs).unsqueeze(0)
        pos = torch.cat([torch.arange(len(d)) for d in docs]).unsqueeze(0)
        model.eval()
        evaluated = model(input_ids=ids, position_ids=pos).logits[0]
        model.set_attn_implementation("eager")
        alone = torch.cat([model(input_ids=d[None]).logits[0] for d in docs])
    report.append({"eval_err": float((evaluated - alone).abs().max())})
    return report


def check_forward_bytes(results, layers=2, sliding=0):
    """plan_stats' bytes_sent_per_layer is what the ranks really sent in one layer's forward (runs
    without checkpointing, whose recomputation sends the forward again); ``sliding`` of the ``layers``
    are a mixed model's sliding layers, which send their own plan's bytes (``sliding_layers``)."""
    for i, run in enumerate(results[0]["value"][:-1]):
        if run["checkpointing"]:
            continue
        sent = sum(v for r in results for kind, v in r["value"][i]["stats"]["rank_bytes_sent_this_step"].items()
                   if kind.startswith("forward"))
        plans = list(run["stats"].get("sliding_layers", {}).values())
        assert len(plans) == (1 if sliding else 0), (i, run["overlap"])
        expected = (layers - sliding) * run["stats"]["bytes_sent_per_layer"] + \
            sum(sliding * p["bytes_sent_per_layer"] for p in plans)
        assert sent == expected, (i, run["overlap"], run["backward"], sent, expected)


def global_stream(doc_lengths, seed=0):
    """A global token stream of documents: ``(tokens [total], positions [total], weights [total, 96])``."""
    g = torch.Generator().manual_seed(seed)
    total = sum(doc_lengths)
    tokens = torch.randint(0, 96, (total,), generator=g)
    positions = torch.cat([torch.arange(n) for n in doc_lengths])
    weights = torch.randn(total, 96, generator=g)
    return tokens, positions, weights


def span_worker(rank, world, family, doc_lengths, slice_lengths, overlaps=("none", "wave", "pingpong"),
                model_overrides=None, checkpointing=(False, True)):
    """Rank ``rank`` holds slice ``rank`` of a global stream of documents (``span_ranks=True``):
    its logits and the sum over ranks of the parameter gradients, against every whole document run
    alone; every overlap mode given, both backward modes, with and without checkpointing,
    ``mode="colocated"``, and evaluation. ``model_overrides``: config fields of the tiny model (e.g.
    a sliding window). Returns one report per run."""
    import torch.distributed as dist

    import distca_hf
    from helpers import checkpointing_disable, checkpointing_enable, param_grads, per_document_reference, tiny_model

    tokens, positions, weights = global_stream(doc_lengths)
    lo = sum(slice_lengths[:rank])
    hi = lo + slice_lengths[rank]
    model = tiny_model(family, max_position_embeddings=max(256, max(doc_lengths)), **(model_overrides or {}))
    bounds = torch.tensor([0, *doc_lengths]).cumsum(0)
    docs = [tokens[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    doc_weights = [weights[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    ref_logits, ref_grads = per_document_reference(model, docs, doc_weights)
    ref_logits = torch.cat(ref_logits)[lo:hi]
    ids, pos = tokens[lo:hi][None], positions[lo:hi][None]
    report = []
    # every overlap and backward mode with and without checkpointing, then colocated (exact too: a
    # continuing piece still receives its prefix K/V)
    runs = [("distca", o, b, c) for o in overlaps for b in ("saved", "resend") for c in checkpointing]
    for mode, overlap, backward, checkpointing in runs + [("colocated", "none", "saved", False)]:
        distca_hf.configure(span_ranks=True, mode=mode, overlap=overlap, backward=backward)
        if checkpointing:
            checkpointing_enable(model, use_reentrant=False)
        else:
            checkpointing_disable(model)
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, position_ids=pos).logits[0]
        (logits * weights[lo:hi]).sum().backward()
        grads = param_grads(model)
        for g in grads.values():
            dist.all_reduce(g)  # the model's gradient is the sum of every rank's
        report.append({
            "mode": mode, "overlap": overlap, "backward": backward, "checkpointing": checkpointing,
            "logit_err": float((logits.detach() - ref_logits).abs().max()),
            "grad_excess": max(float(((grads[n] - ref_grads[n]).abs() - 1e-4 * ref_grads[n].abs()).max())
                               for n in ref_grads),
            "same_grad_keys": sorted(grads) == sorted(ref_grads),
            "stats": distca_hf.plan_stats(),
        })
    distca_hf.configure(mode="distca")
    checkpointing_disable(model)
    with torch.no_grad():
        model.eval()
        evaluated = model(input_ids=ids, position_ids=pos).logits[0]
        model.train()
    report.append({"eval_err": float((evaluated - ref_logits).abs().max())})
    return report


def span_refusal_worker(rank, world, claimed_position):
    """Rank 1 claims to continue at ``claimed_position`` a document that rank 0 does not end with that
    many tokens; every rank must raise."""
    import distca_hf
    from helpers import tiny_model

    distca_hf.configure(span_ranks=True)
    model = tiny_model("llama")
    if rank == 0:
        pos = torch.cat([torch.arange(10), torch.arange(6)])[None]
    else:
        pos = torch.arange(claimed_position, claimed_position + 8)[None]
    try:
        model(input_ids=torch.randint(0, 96, pos.shape), position_ids=pos)
    except (ValueError, RuntimeError) as e:
        return {"raised": type(e).__name__, "message": str(e)}
    return {"raised": None}


def exact_runs(results, runs_per_rank: int):
    """Check the reports of ``exactness_worker`` / ``span_worker`` on every rank: each rank ran,
    evaluation and every run match the reference (fp32: 1e-5); returns ``[(rank, runs)]``."""
    checked = []
    for rank, result in enumerate(results):
        assert result["ok"], f"rank {rank}: {result.get('traceback', result['error'])}"
        *runs, evaluation = result["value"]
        assert evaluation["eval_err"] < 1e-5
        assert len(runs) == runs_per_rank
        for run in runs:
            assert run["same_grad_keys"]
            assert run["logit_err"] < 1e-5, (rank, run)
            assert run["grad_excess"] < 1e-5, (rank, run)
        checked.append((rank, runs))
    return checked


def span_workers(rank, world, cases):
    """``span_worker`` for several ``(family, doc_lengths, slice_lengths, overlaps, model_overrides)``
    cases in one set of processes (a spawn costs seconds); returns ``{family: reports}``."""
    import distca_hf

    reports = {}
    for family, doc_lengths, slice_lengths, overlaps, overrides in cases:
        reports[family] = span_worker(rank, world, family, doc_lengths, slice_lengths, overlaps, overrides, (False,))
        distca_hf.configure(span_ranks=False, overlap="none", backward="saved")
    return reports
