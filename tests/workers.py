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
    from helpers import objective_weights, param_grads, per_document_reference, tiny_model

    model = tiny_model(family)
    report = []
    for backward in ("saved", "resend"):
        for checkpointing in (False, True):
            distca_hf.configure(backward=backward, overlap=overlap)
            if checkpointing:
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.activation_checkpointing_disable()
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


def check_forward_bytes(results, layers=2):
    """plan_stats' bytes_sent_per_layer is what the ranks really sent in one layer's forward (runs
    without checkpointing, whose recomputation sends the forward again)."""
    for i, run in enumerate(results[0]["value"][:-1]):
        if run["checkpointing"]:
            continue
        sent = sum(v for r in results for kind, v in r["value"][i]["stats"]["rank_bytes_sent_this_step"].items()
                   if kind.startswith("forward"))
        assert sent == layers * run["stats"]["bytes_sent_per_layer"], (i, run["backward"], sent)
