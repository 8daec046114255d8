"""``distca-hf bench``: a real multi-process step-time comparison, colocated against distca.

Every rank builds the same small Llama-like model and its own skewed packed batch: even ranks hold
one long document, odd ranks many short ones (the straggler pattern CAD removes). Both methods run
the same data with the same exact per-document kernel; *colocated* computes each rank's documents
where they are, *distca* plans and dispatches. Step time is forward + backward, timed between
barriers (so it is the slowest rank's), median over ``--steps`` after ``--warmup``. The methods
take turns step by step (colocated, then each distca setting, then again), so the ratios are
measured side by side even on a machine whose speed drifts.

``--overlap none,wave,pingpong`` also runs the overlap modes; for each it reports the step time and
``overlap_fraction``: communication time hidden under compute / total communication time, from the
timeline (``distca_hf.runtime.timeline``: an all-to-all lasts from launch to completion, and the time a rank
blocks waiting for it is the part not hidden), over all ranks, forward and backward apart.
``--trace OUT.json`` writes the last step of each mode as a Chrome trace.

The *ideal* is measured from the colocated run: each rank's time outside the attention kernel plus
the mean over ranks of the kernel time, i.e. the step if attention were perfectly balanced and
communication were free.

CPU: ``distca-hf bench`` (gloo, one thread per process). GPUs: ``distca-hf bench --world N`` on a
machine with N GPUs (NCCL, bf16, flash-attn when installed), or under ``torchrun --nproc-per-node N
-m distca_hf bench``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

from ..planning.cost import imbalance

__all__ = ["main"]


def _batch(rank: int, tokens: int, short_docs: int):
    """Document lengths of ``rank``'s micro-batch: one long document on even ranks, ``short_docs``
    equal ones (the remainder spread over the first) on odd ranks."""
    if rank % 2 == 0:
        return [tokens]
    base = tokens // short_docs
    return [base + (1 if i < tokens % short_docs else 0) for i in range(short_docs)]


def _worker(rank: int, world: int, args, port: int, result_path: str | None):
    """One rank of the benchmark: set up, run every method in turns, gather, write (rank 0)."""
    import torch.distributed as dist

    from ..runtime import timeline

    device = _init_process(rank, world, args, port)
    step = _training_step(rank, args, device)
    kernel_seconds = _time_kernels(device)
    methods = _methods(args)
    timeline.enable()
    runs = _run_in_turns(step, methods, args, kernel_seconds, device)
    results = _gather_results(runs, methods, rank, world, args)
    if rank == 0 and result_path:
        with open(result_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def _init_process(rank: int, world: int, args, port: int):
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    use_cuda = args.device == "cuda"
    torch.set_num_threads(args.threads)
    if use_cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=args.timeout))
    return torch.device("cuda" if use_cuda else "cpu")


def _training_step(rank: int, args, device):
    """The model (same weights on every rank), this rank's skewed batch, and one forward + backward."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    import distca_hf  # noqa: F401  (registers "distca")

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.tokens, use_cache=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="distca").to(device, getattr(torch, args.dtype))
    lengths = _batch(rank, args.tokens, args.short_docs)
    g = torch.Generator().manual_seed(rank)
    input_ids = torch.randint(0, args.vocab, (1, sum(lengths)), generator=g).to(device)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).to(device)

    def step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=input_ids, position_ids=position_ids).logits
        out.float().square().mean().backward()

    return step


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _time_kernels(device) -> list[float]:
    """Wrap the kernel entry points so the colocated path's attention seconds add up in the returned
    one-element list (the measured ideal needs them)."""
    from .. import kernels

    seconds = [0.0]

    def timed(fn):
        def wrapper(*a, **k):
            _sync(device)
            start = time.perf_counter()
            result = fn(*a, **k)
            _sync(device)
            seconds[0] += time.perf_counter() - start
            return result
        return wrapper

    kernels.varlen_attention_forward = timed(kernels.varlen_attention_forward)
    kernels.varlen_attention_backward = timed(kernels.varlen_attention_backward)
    return seconds


def _methods(args) -> list[tuple[str, str, str]]:
    """``(mode, backward, overlap)`` of every method, colocated first."""
    modes = ["saved", "resend"] if args.backward == "both" else [args.backward]
    overlaps = args.overlap.split(",")
    return [("colocated", "saved", "none")] + [("distca", b, o) for b in modes
                                               for o in (overlaps if b == modes[0] else overlaps[:1])]


def _run_in_turns(step, methods, args, kernel_seconds, device) -> dict:
    """Every method runs once per round, in the same order, so a machine whose speed drifts (another
    job, thermal limits) affects all of them alike: the ratios are measured side by side. Returns
    per method a list of ``(step seconds, (this rank's seconds, its kernel seconds), plan_stats,
    timeline events)``."""
    import torch.distributed as dist

    import distca_hf
    from ..runtime import timeline

    def configure(mode, backward_mode, overlap):
        distca_hf.configure(mode=mode, backward=backward_mode, tolerance=args.tolerance, overlap=overlap)

    def timed_step(*method):
        configure(*method)
        kernel_seconds[0] = 0.0
        timeline.clear()
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        step()
        _sync(device)
        mine = time.perf_counter() - start
        dist.barrier()
        return time.perf_counter() - start, (mine, kernel_seconds[0]), distca_hf.plan_stats(), timeline.events()

    for method in methods:
        configure(*method)
        for _ in range(args.warmup):
            step()
    runs = {method: [] for method in methods}
    for _ in range(args.steps):
        for method in methods:
            runs[method].append(timed_step(*method))
    return runs


def _gather_results(runs: dict, methods, rank: int, world: int, args) -> dict:
    """Every rank's timings, bytes and timeline events, combined per method (rank 0 writes them)."""
    import torch.distributed as dist

    from ..runtime.timeline import chrome_trace, overlap_summary

    results = {}
    colocated = runs[methods[0]]
    results["colocated"] = {"step_s": [r[0] for r in colocated]}
    everyone = [None] * world
    dist.all_gather_object(everyone, [r[1] for r in colocated])
    # per step: slowest rank's non-attention time + mean attention time
    results["ideal_step_s"] = [max(r[i][0] - r[i][1] for r in everyone) + sum(r[i][1] for r in everyone) / world
                               for i in range(args.steps)]
    overlaps = args.overlap.split(",")
    for (_, backward_mode, overlap) in methods[1:]:
        done = runs[("distca", backward_mode, overlap)]
        stats = done[-1][2]
        sent = [None] * world
        dist.all_gather_object(sent, (sum(stats["rank_bytes_sent_this_step"].values()),
                                      stats["rank_saved_for_backward_bytes"],
                                      [r[3] for r in done]))  # each step's timeline events
        key = f"distca_{backward_mode}" if overlap == overlaps[0] else f"distca_{backward_mode}_{overlap}"
        results[key] = {
            "step_s": [r[0] for r in done], "stats": stats, "overlap": overlap,
            "bytes_sent_per_step": sum(s[0] for s in sent),
            "saved_for_backward_bytes_max_rank": max(s[1] for s in sent),
            # one step's overlap over all ranks: their communication and blocked seconds summed
            "overlap_per_step": [overlap_summary([e for s in sent for e in s[2][i]]) for i in range(args.steps)],
        }
        if rank == 0 and args.trace and backward_mode == methods[1][1]:
            chrome_trace([s[2][-1] for s in sent], _trace_path(args.trace, overlap, len(overlaps)))
    return results


def _trace_path(path: str, overlap: str, modes: int) -> str:
    if modes == 1:
        return path
    stem, dot, ext = path.rpartition(".")
    return f"{stem}.{overlap}.{ext}" if dot else f"{path}.{overlap}"


def _median_overlap(steps: list[dict]) -> dict:
    """The step with the median overlap fraction (its forward/backward split comes with it)."""
    ordered = sorted(steps, key=lambda d: d["overlap_fraction"])
    return ordered[len(ordered) // 2]


def summarize(results: dict, args) -> dict:
    median = statistics.median
    colocated = median(results["colocated"]["step_s"])
    ideal = median(results["ideal_step_s"])
    first = "distca_" + ("saved" if args.backward in ("saved", "both") else "resend")
    distca = median(results[first]["step_s"])
    stats = results[first]["stats"]
    summary = {
        "colocated_step_s": colocated,
        "distca_step_s": distca,
        "speedup": colocated / distca,
        "attn_imbalance_before": imbalance(stats["attn_pairs_local"]),
        "attn_imbalance_after": imbalance(stats["attn_pairs_served"]),
        "ideal_step_s": ideal,
        "distca_over_ideal": distca / ideal,
        "ideal_speedup": colocated / ideal,
        "world": args.world,
        "device": args.device,
        "bytes_sent_per_layer_forward": stats["bytes_sent_per_layer"],
        "overlap_mode": results[first]["overlap"],
        "overlap_fraction": _median_overlap(results[first]["overlap_per_step"])["overlap_fraction"],
    }
    summary["overlap"] = {}
    for key, r in results.items():
        if key.startswith(first) and "overlap" in r:
            o = _median_overlap(r["overlap_per_step"])
            summary["overlap"][r["overlap"]] = {
                "step_s": median(r["step_s"]), "speedup_vs_colocated": colocated / median(r["step_s"]),
                "overlap_fraction": o["overlap_fraction"],
                "forward_overlap_fraction": o["forward"]["overlap_fraction"],
                "backward_overlap_fraction": o["backward"]["overlap_fraction"],
                "comm_s_all_ranks": o["comm_s"], "exposed_comm_s_all_ranks": o["exposed_s"],
            }
    for mode in ("saved", "resend"):
        if f"distca_{mode}" in results:
            r = results[f"distca_{mode}"]
            summary[f"backward_{mode}"] = {
                "step_s": median(r["step_s"]),
                "bytes_sent_per_step_all_ranks": r["bytes_sent_per_step"],
                "saved_for_backward_bytes_max_rank": r["saved_for_backward_bytes_max_rank"],
            }
    return summary


def format_table(s: dict) -> str:
    rows = [
        ("world / device", f"{s['world']} x {s['device']}"),
        ("attention imbalance before -> after", f"{s['attn_imbalance_before']:.2f} -> {s['attn_imbalance_after']:.3f}"),
        ("colocated step (median)", f"{s['colocated_step_s']:.3f} s"),
        ("distca step (median)", f"{s['distca_step_s']:.3f} s"),
        ("speedup", f"{s['speedup']:.2f}x"),
        ("ideal step (balanced, free comm)", f"{s['ideal_step_s']:.3f} s  ({s['ideal_speedup']:.2f}x)"),
        ("distca / ideal", f"{s['distca_over_ideal']:.3f}"),
        ("bytes per layer forward (all ranks)", f"{s['bytes_sent_per_layer_forward'] / 1e6:.2f} MB"),
    ]
    for overlap, o in s["overlap"].items():
        rows.append((f"overlap={overlap}: step / speedup / comm hidden (fwd, bwd)",
                     f"{o['step_s']:.3f} s / {o['speedup_vs_colocated']:.2f}x / {o['overlap_fraction']:.2f} "
                     f"({o['forward_overlap_fraction']:.2f}, {o['backward_overlap_fraction']:.2f})"))
    for mode in ("saved", "resend"):
        if f"backward_{mode}" in s:
            b = s[f"backward_{mode}"]
            rows.append((f"backward={mode}: step / bytes per step / kept for backward (max rank)",
                         f"{b['step_s']:.3f} s / {b['bytes_sent_per_step_all_ranks'] / 1e6:.1f} MB / "
                         f"{b['saved_for_backward_bytes_max_rank'] / 1e6:.1f} MB"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world", type=int, default=2, help="processes (GPUs on a CUDA machine)")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    parser.add_argument("--short-docs", type=int, default=32, help="documents on the odd (short) ranks")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=688)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--backward", choices=["saved", "resend", "both"], default="saved")
    parser.add_argument("--tolerance", type=float, default=0.02)
    parser.add_argument("--overlap", default="none",
                        help="none|wave|pingpong, or several separated by commas (the first gives distca_step_s)")
    parser.add_argument("--trace", metavar="OUT.json", help="write the last step's Chrome trace (one file per mode "
                        "when several: OUT.<mode>.json)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--timeout", type=float, default=600.0, help="process-group timeout (s)")
    parser.add_argument("--json", action="store_true", help="print a JSON object")


def run_cli(args, parser) -> int:
    import tempfile

    import torch
    import torch.multiprocessing as mp

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    for name in ("world", "tokens", "short_docs", "layers", "steps", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.world < 2 and "WORLD_SIZE" not in os.environ:
        parser.error("--world must be >= 2: the benchmark compares ranks")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        parser.error("--hidden must be a multiple of --heads, and --heads a multiple of --kv-heads")
    if args.short_docs > args.tokens:
        parser.error("--short-docs cannot exceed --tokens")
    overlaps = args.overlap.split(",")
    bad = [o for o in overlaps if o not in ("none", "wave", "pingpong")]
    if bad or len(set(overlaps)) != len(overlaps):
        parser.error(f"--overlap takes distinct values among none, wave, pingpong separated by commas; got {args.overlap!r}")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.json")
        if "WORLD_SIZE" in os.environ and "RANK" in os.environ:  # under torchrun
            args.world = int(os.environ["WORLD_SIZE"])
            rank = int(os.environ["RANK"])
            _worker(rank, args.world, args, int(os.environ.get("MASTER_PORT", 29500)), path if rank == 0 else None)
            if rank != 0:
                return 0
        else:
            from ..runtime.comm import free_port

            mp.start_processes(_worker, args=(args.world, args, free_port(), path), nprocs=args.world,
                               start_method="spawn")
        with open(path) as f:
            results = json.load(f)
    summary = summarize(results, args)
    print(json.dumps(summary) if args.json else format_table(summary))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="distca-hf bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_cli(parser.parse_args(argv), parser)


if __name__ == "__main__":
    sys.exit(main())
