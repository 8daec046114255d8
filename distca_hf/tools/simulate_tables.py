"""The text tables of ``distca-hf simulate`` (its ``simulate`` and ``--pipeline-parallel`` objects),
and the methods' names they print."""

from __future__ import annotations

from ..planning.pipeline_bound import bubble_gain
from ..planning.pipeline_cost import PIPELINE_METHODS

__all__ = ["METHODS", "LABELS", "PIPELINE_LABELS", "format_table", "format_pipeline_table"]

METHODS = ("colocated", "wlb", "per_doc_cp", "ulysses", "distca")
LABELS = {"colocated": "colocated packing", "wlb": "WLB-LLM packing", "per_doc_cp": "per-document CP",
          "ulysses": "Ulysses SP", "distca": "distca"}
PIPELINE_LABELS = {"colocated_1f1b": "stock 1F1B, colocated packing",
                   "balanced_micro_batches": "stock 1F1B, micro-batches balanced for attention",
                   "cad_per_stage": "stock 1F1B, CAD inside each stage",
                   "cad_across_stages": "CAD across stages (lockstep 1F1B, bubbles serve)"}



def _label(method: str, result: dict) -> str:
    degree = result.get(method, {}).get("degree") if method in ("per_doc_cp", "ulysses") else None
    if degree == 1:  # no group: data parallel, whole documents per rank
        return LABELS[method] + " (degree 1: data parallel)"
    return LABELS[method] + (f" (degree {degree})" if degree else "")


def _max_mean(stat: dict) -> str:
    return f"{stat['max']:,.0f} / {stat['mean']:,.0f}"


def format_table(result: dict) -> str:
    d = result["distca"]
    tm = result["time_model"]
    best, tuned = result["best_baseline"], result["tuned_baseline"]
    rows = [
        ("ranks x tokens per rank", f"{result['ranks']} x {result['tokens_per_rank']} ({result['batches']} batches)"),
        (f"estimated speedup vs best baseline ({_label(best, result)})", f"{result['speedup_vs_best_baseline']:.2f}x"),
        ("estimated speedup vs colocated", f"{result['speedup_vs_colocated']:.2f}x"),
        (f"vs the baselines tuned for speed ({_label(tuned['method'], {tuned['method']: tuned})})",
         f"{result['speedup_vs_tuned_baseline']:.2f}x"),
    ]
    for m in METHODS:
        r = result[m]
        if r["step_time_s"] is None:
            rows.append((f"layer time, {_label(m, result)}", f"n/a: {r['unavailable']}"))
            continue
        comm = r["exposed_comm_s"]
        rows.append((f"layer time, {_label(m, result)} (of it: exposed comm)",
                     f"{1e3 * r['step_time_s']:.2f} ms ({1e3 * comm:.2f} ms)"))
    rows += [
        ("time model", f"{tm['source']}; {tm['bytes_per_s'] / 1e9:g} GB/s per rank, "
                       f"{100 * result['hidden_comm_fraction']:.0f}% of communication hidden"),
        ("distca planner", f"tolerance {result['planner']['tolerance']}, block {result['planner']['block']}"),
        ("attention imbalance, colocated", f"{result['colocated']['attn_imbalance']:.3f}"),
        (f"attention imbalance, WLB-LLM packing (queue above {result['wlb']['threshold_tokens']} tokens)",
         f"{result['wlb']['attn_imbalance']:.3f}"),
        ("attention imbalance, distca (mean / worst)", f"{d['attn_imbalance']:.4f} / {d['worst_attn_imbalance']:.4f}"),
        ("queries moved", f"{100 * d['moved_query_fraction']:.1f}%"),
        ("distca tasks per server (max / mean), smallest moved shard",
         f"{d['tasks_per_server']['max']:.1f} / {d['tasks_per_server']['mean']:.1f}, "
         f"{'-' if d['smallest_shard_tokens'] is None else d['smallest_shard_tokens']} tokens"),
        ("bytes per layer, distca", f"{d['comm_bytes_per_layer'] / 1e9:.3f} GB"),
        (f"bytes per layer, {_label('per_doc_cp', result)}",
         f"{result['per_doc_cp']['comm_bytes_per_layer'] / 1e9:.3f} GB"),
    ]
    if result["ulysses"]["step_time_s"] is not None:
        rows.append((f"bytes per layer, {_label('ulysses', result)}",
                     f"{result['ulysses']['comm_bytes_per_layer'] / 1e9:.3f} GB"))
    rows += [
        ("K/V tokens received per layer, distca (max / mean server)", _max_mean(d["kv_received_tokens_per_layer"])),
        ("K/V tokens received per layer, CP of spanning documents (max / mean rank)",
         _max_mean(result["per_doc_cp"]["kv_received_tokens_per_layer"])),
        ("servers per long document, distca (mean / max)", "{mean:.1f} / {max:.0f}".format(**d["servers_per_long_document"])),
        ("plan time (median)", f"{d['plan_ms_median']:.2f} ms"),
    ]
    for m in METHODS:
        if "memory_imbalance" in result[m]:
            added = result[m]["memory_bytes_per_layer"]
            rows.append((f"memory for backward per layer, {_label(m, result)}: imbalance (added max / mean MB)",
                         f"{result[m]['memory_imbalance']:.2f} ({added['max'] / 1e6:,.1f} / {added['mean'] / 1e6:,.1f})"))
    rows.append(("distca batches planned in resend mode (memory budget)", f"{100 * d['resend_batch_fraction']:.0f}%"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def format_pipeline_table(pipeline: dict) -> str:
    """The ``--pipeline-parallel`` section of the table."""
    p, m, d = pipeline["stages"], pipeline["micro_batches"], pipeline["data_parallel"]
    floors = pipeline["floor_step_time_s"]
    rows = [("pipeline: stages x data-parallel pipelines, micro-batches per step",
             f"{p} x {d}, {m} micro-batches of {pipeline['tokens_per_micro_batch_row']} tokens per row "
             f"({pipeline['steps']} steps, {pipeline['layers']} layers, {pipeline['layers_per_stage']} per stage)")]
    for method in PIPELINE_METHODS:
        rows.append((f"step time, {PIPELINE_LABELS[method]} (bubble, attention imbalance)",
                     f"{pipeline['step_time_s'][method]:.3f} s ({100 * pipeline['bubble_fraction'][method]:.0f}%, "
                     f"{pipeline['attn_imbalance'][method]:.2f})"))
    rows += [
        ("speedup of CAD across stages vs stock 1F1B colocated", f"{pipeline['speedup_vs_colocated_1f1b']:.2f}x"),
        ("speedup of CAD across stages vs balanced micro-batches",
         f"{pipeline['speedup_vs_balanced_micro_batches']:.2f}x"),
        ("speedup of CAD across stages vs CAD inside each stage", f"{pipeline['speedup_vs_cad_per_stage']:.2f}x"),
        ("  bound on it (attention spread evenly, bytes only on documents' holders)",
         f"{pipeline['speedup_bound_vs_cad_per_stage']:.2f}x (floors {floors['cad_per_stage']:.3f} / "
         f"{floors['cad_across_stages']:.3f} s; attention {100 * pipeline['attention_share']:.0f}% of compute, equal micro-batches would gain "
         f"{bubble_gain(stages=p, micro_batches=m, attention_share=pipeline['attention_share']):.2f}x)"),
        ("micro-batches held per stage, 1F1B / CAD across stages",
         f"{pipeline['held_micro_batches']['1f1b']} / {pipeline['held_micro_batches']['cad_across_stages']}"),
        ("activations between stages per micro-batch", f"{1e3 * pipeline['p2p_s_per_micro_batch']:.2f} ms"),
    ]
    if "note" in pipeline:
        rows.append(("note", pipeline["note"]))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
