"""The JSON and the table of ``distca-hf bench --pipeline-parallel P``, and the check that every
method computed what the baseline computed (``check_agreement``).
"""

from __future__ import annotations

import os
import statistics

from .model import MODEL_DEFAULTS
from .pipeline import AGREEMENT_RTOL, METHODS, PIPELINE_DEFAULTS, PIPELINE_TARGET, micro_batch_imbalance
from .summaries import per_step_ratios


def check_agreement(results: dict, rtol: float) -> dict:
    """Every method's per-round loss and gradient norm against the baseline's: the largest relative
    differences and whether they are within ``rtol`` (same model, same rows: they must agree)."""
    base = results["methods"][METHODS[0][0]]
    worst = {"loss": 0.0, "grad_norm": 0.0}
    for name, _, _ in METHODS[1:]:
        other = results["methods"][name]
        for key in worst:
            for a, b in zip(base[key], other[key]):
                worst[key] = max(worst[key], abs(a - b) / max(abs(a), 1e-12))
    return {"max_loss_rel_diff": worst["loss"], "max_grad_norm_rel_diff": worst["grad_norm"], "rtol": rtol,
            "agree": all(v <= rtol for v in worst.values())}


def _ratios(baseline: list[float], other: list[float]) -> dict:
    return per_step_ratios(baseline, other)


def summarize_pipeline(results: dict, args) -> dict:
    """The JSON of ``--pipeline-parallel``: each method's median step (``<method>_step_s``),
    ``speedup`` (median per-round ratio colocated_1f1b / cad_across_stages), ``per_step_speedup``
    (min / median / max over rounds, against colocated_1f1b and cad_per_stage), the agreement check
    and per round the step times, losses and every rank's own time."""
    median = statistics.median
    methods = results["methods"]
    across = methods["cad_across_stages"]["step_s"]
    per_step = {name: _ratios(methods[name]["step_s"], across) for name in ("colocated_1f1b", "cad_per_stage")}
    summary = {
        "workload": args.workload,
        "pipeline_parallel": args.pipeline_parallel,
        "data_parallel": results["data_parallel"],
        "micro_batches": args.micro_batches,
        "world": args.world,
        "device": args.device,
        "dtype": args.dtype,
        "tokens_per_micro_batch": args.tokens,
        "layers": args.layers,
        "rounds": args.steps,
        "tolerance": args.tolerance,
        **{f"{name}_step_s": median(m["step_s"]) for name, m in methods.items()},
        "speedup": per_step["colocated_1f1b"]["median"],
        "speedup_vs_cad_per_stage": per_step["cad_per_stage"]["median"],
        "per_step_speedup": per_step,
        "micro_batch_attn_imbalance": micro_batch_imbalance(results["lengths"]),
        # query tokens computed away from their rank under each method's plans (rank 0's view, median)
        "moved_query_fraction": {name: median(m.get("moved_query_fraction") or [0.0]) for name, m in methods.items()},
        # CPU seconds of a step summed over the ranks (median over rounds): the work itself, which the
        # step time exceeds by what ranks spend waiting (bubbles, peers, other processes on the cores)
        "cpu_s_all_ranks": {name: median([sum(r[i] for r in m["rank_cpu_s"]) for i in range(len(m["step_s"]))])
                            for name, m in methods.items()},
        "check": check_agreement(results, AGREEMENT_RTOL[args.dtype]),
        # the machine's 1-minute load average before and after the run, and its cores: the lockstep
        # schedule meets every rank at every layer, so other processes competing for the cores slow it
        # more than torch's 1F1B
        "load_average": results.get("load_average"),
        "cpu_count": os.cpu_count(),
        "steps": {name: {"step_s": m["step_s"], "loss": m["loss"], "grad_norm": m["grad_norm"],
                         "rank_own_s": m["rank_own_s"], "rank_cpu_s": m["rank_cpu_s"]}
                  for name, m in methods.items()},
    }
    # cad_per_stage has no other copy to balance over with one rank per stage: say so in the output
    summary["cad_per_stage_note"] = ("data parallel 1: cad_per_stage runs colocated_1f1b's attention (no other "
                                     "copy of the stage to balance over)" if results["data_parallel"] == 1 else
                                     f"CA-tasks balanced over each stage's {results['data_parallel']} copies")
    if args.workload in PIPELINE_TARGET and _default_sizes(args):
        goal = PIPELINE_TARGET[args.workload]
        summary["target"] = {"median_speedup_at_least": goal, "met": summary["speedup"] >= goal}
    return summary


def _default_sizes(args) -> bool:
    return (args.world == 2 and args.pipeline_parallel == 2 and args.device == "cpu"
            and all(getattr(args, k) == v for k, v in {**MODEL_DEFAULTS, **PIPELINE_DEFAULTS}.items()
                    if k not in ("steps", "warmup")))


def format_pipeline_table(s: dict) -> str:
    def ratios(r):
        return f"{r['min']:.2f} / {r['median']:.2f} / {r['max']:.2f}x"

    check = s["check"]
    rows = [
        ("pipeline", f"{s['pipeline_parallel']} stages x {s['data_parallel']} data-parallel ({s['world']} "
                     f"processes, {s['device']}, {s['dtype']}), {s['layers']} layers"),
        ("step", f"{s['micro_batches']} micro-batches of {s['tokens_per_micro_batch']} tokens per copy, workload "
                 f"{s['workload']} (costliest micro-batch / mean attention: {s['micro_batch_attn_imbalance']:.2f})"),
        ("colocated_1f1b (torch 1F1B, colocated)", f"{s['colocated_1f1b_step_s']:.3f} s"),
        ("cad_per_stage (torch 1F1B, CAD per stage)", f"{s['cad_per_stage_step_s']:.3f} s"),
        ("cad_across_stages (cad_1f1b)", f"{s['cad_across_stages_step_s']:.3f} s"),
        ("CPU seconds per step, all ranks (colocated / per stage / across)",
         " / ".join(f"{v:.2f}" for v in s["cpu_s_all_ranks"].values())),
        ("speedup vs colocated_1f1b (min / median / max per round)", ratios(s["per_step_speedup"]["colocated_1f1b"])),
        ("speedup vs cad_per_stage (min / median / max per round)", ratios(s["per_step_speedup"]["cad_per_stage"])),
        ("methods agree (loss, grad norm: max relative diff)",
         f"{'yes' if check['agree'] else 'NO'} ({check['max_loss_rel_diff']:.1e}, "
         f"{check['max_grad_norm_rel_diff']:.1e}; rtol {check['rtol']:g})"),
        ("note", s["cad_per_stage_note"]),
    ]
    if s.get("load_average"):
        before, after = s["load_average"]
        busy = " (busy: other processes competed for the cores)" if max(before, after) > s["cpu_count"] else ""
        rows.append(("load average before / after (cores)", f"{before:.1f} / {after:.1f} ({s['cpu_count']}){busy}"))
    if "target" in s:
        t = s["target"]
        rows.append(("target", f">= {t['median_speedup_at_least']}x median: {'met' if t['met'] else 'NOT met'}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
