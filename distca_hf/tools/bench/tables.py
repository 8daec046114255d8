"""The bench's tables: a summary (``summaries``) as the text ``distca-hf bench`` prints without ``--json``."""

from __future__ import annotations

from .demo_data import DEMO_TARGET


def format_long_table(s: dict) -> str:
    names = {"distca": "distca", "cp": "per-document CP", "ulysses": "Ulysses (DeepSpeed ALST)",
             "colocated": "colocated-where-possible (NOT exact)"}
    header = ("method", "step (median)", "distca speedup per step (min/median/max)", "bytes/layer fwd (all ranks)",
              "peak tensor memory", "kept for backward", "attn imbalance")
    rows = [header]
    for name, m in s["methods"].items():
        ratio = s["per_step_speedup"].get(name)
        rows.append((names[name], f"{m['step_s']:.3f} s",
                     "-" if ratio is None else f"{ratio['min']:.2f} / {ratio['median']:.2f} / {ratio['max']:.2f}x",
                     f"{m['bytes_per_layer_forward'] / 1e6:.2f} MB", f"{m['peak_bytes_max_rank'] / 1e6:.1f} MB",
                     f"{m['kept_for_backward_bytes_max_rank'] / 1e6:.1f} MB", f"{m['attn_imbalance']:.3f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [f"workload long: {s['world']} x {s['device']}, {s['tokens_per_rank']} tokens per rank; one "
             f"{s['long_tokens']}-token document over every rank beside {s['short_documents']} short documents "
             f"(up to {s['short_tokens']} tokens)",
             f"attention imbalance (each rank its own queries, whole prefixes) -> distca plan: "
             f"{s['attn_imbalance_before']:.2f} -> {s['attn_imbalance_after']:.3f}"]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.append("memory: max over ranks of tensor bytes allocated during one forward + backward and alive at once "
                 "(peak) or when the forward ends (kept); colocated-where-possible computes each piece alone: the "
                 "no-communication lower bound, not the spanning document's attention")
    if "ulysses_skipped" in s:
        lines.append(f"Ulysses not run: {s['ulysses_skipped']}")
    return "\n".join(lines)


def _ratios(r: dict) -> str:
    return f"{r['min']:.2f} / {r['median']:.2f} / {r['max']:.2f}x"


def _met(flag: bool) -> str:
    return "met" if flag else "MISSED"


def format_table(s: dict) -> str:
    ratio = s["per_step_speedup"]["colocated"]
    target = s.get("target")
    demo = s["workload"] == "demo"
    step = "mean over batches, each its fastest round" if demo else "median"
    if demo:
        whole = "" if target is None else (f"  (target >= {target['whole_run_speedup_at_least']}x, "
                                           f"{_met(target['whole_run_met'])})")
        per_step = "" if target is None else (f"  (target: every batch >= {target['per_step_speedup_at_least']}x, "
                                              f"{_met(target['per_step_met'])})")
    else:
        whole = ""
        per_step = "" if target is None else (f"  (target: median >= {target['median_speedup_at_least']}x, "
                                              f"{_met(target['met'])})")
    rows = [
        ("workload / world / device", f"{s['workload']} / {s['world']} x {s['device']}, {s['tokens_per_rank']} tokens "
                                      f"per rank, tolerance {s['tolerance']}"),
    ]
    if demo:
        rows += [("packing", s["packing"]),
                 ("rounds", f"{s['rounds']} measured after {s['warmup_rounds']} warm-up, each every one of "
                            f"{s['global_batches']} global batches in order, the methods in turns on each")]
    rows += [
        ("attention imbalance before -> after", f"{s['attn_imbalance_before']:.2f} -> {s['attn_imbalance_after']:.3f}"
                                                f"  ({s['moved_query_fraction']:.1%} of queries moved)"),
        (f"colocated step ({step})", f"{s['colocated_step_s']:.3f} s"),
        (f"distca step ({step})", f"{s['distca_step_s']:.3f} s"),
        ("speedup" + (" (whole run: sum colocated / sum distca)" if demo else ""), f"{s['speedup']:.2f}x" + whole),
        ("per-step speedup min / median / max", _ratios(ratio) + per_step),
    ]
    if demo:
        rows.append(("batches more than 3% slower", f"{s['batches_more_than_3pct_slower']} of {s['global_batches']}"))
    if "ideal_step_s" in s:  # not for demo: its colocated steps communicate
        rows += [("ideal step (balanced, free comm)", f"{s['ideal_step_s']:.3f} s  ({s['ideal_speedup']:.2f}x)"),
                 ("distca / ideal", f"{s['distca_over_ideal']:.3f}")]
    rows += [
        ("bytes per layer forward (all ranks)", f"{s['bytes_sent_per_layer_forward'] / 1e6:.2f} MB"),
    ]
    for overlap, o in s["overlap"].items():
        rows.append((f"overlap={overlap}: step / per-step speedup / comm hidden (fwd, bwd)",
                     f"{o['step_s']:.3f} s / {_ratios(o['per_step_speedup'])} / {o['overlap_fraction']:.2f} "
                     f"({o['forward_overlap_fraction']:.2f}, {o['backward_overlap_fraction']:.2f})"))
    for mode in ("saved", "resend"):
        if f"backward_{mode}" in s:
            b = s[f"backward_{mode}"]
            rows.append((f"backward={mode}: step / per-step speedup / bytes per step / kept for backward (max rank)",
                         f"{b['step_s']:.3f} s / {_ratios(b['per_step_speedup'])} / "
                         f"{b['bytes_sent_per_step_all_ranks'] / 1e6:.1f} MB / "
                         f"{b['saved_for_backward_bytes_max_rank'] / 1e6:.1f} MB"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    if demo:
        lines += ["", _format_batches(s)]
    return "\n".join(lines)


def _format_batches(s: dict) -> str:
    """The demo's batches one per line: each method's fastest round, their ratio, the plan."""
    steps = s["steps"]
    header = ("batch", "colocated (fastest)", "distca (fastest)", "speedup", "attn imbalance before -> after",
              "queries moved")
    rows = [header] + [
        (str(b + 1), f"{c:.3f} s", f"{d:.3f} s", f"{r:.2f}x" + (" *" if r < DEMO_TARGET["per_step_speedup_at_least"]
                                                               else ""),
         f"{p['before']:.2f} -> {p['after']:.3f}", f"{p['moved_query_fraction']:.1%}")
        for b, (c, d, r, p) in enumerate(zip(steps["colocated_step_s"], steps["distca_step_s"], steps["speedup"],
                                             steps["plans"]))]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines + [f"(*: more than 3% slower than colocated; times are each batch's fastest of "
                               f"{s['rounds']} rounds)"])
