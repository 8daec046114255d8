"""Side-by-side timing of the exact attention paths for a fused batch of CA-tasks (``distca-hf kernel-bench``).

On CPU (``--device cpu``, the default without CUDA) every candidate computes the same bottom-right
causal attention, forward + backward, on the same tensors; the table reports milliseconds and the
ratio to the fastest. The ``torch_cpu`` backend is the default because it wins here. Candidates:

- ``torch_cpu``: the backend (CPU flash kernel, diagonal/prefix split, one call per task);
- ``torch_cpu_stacked``: the same kernel with same-shape tasks stacked into one call;
- ``sdpa_mask``: ``F.scaled_dot_product_attention`` per task with an explicit bottom-right mask;
- ``math``: the plain-torch backend;
- ``dense_packed_sdpa``: one SDPA over the whole packed batch with a ``[T, T]`` document mask,
  which is what HF's ``sdpa`` does on packed input (cost independent of document lengths);
- ``flex_attention`` (``--flex``): compiled, forward only: torch has no flex backward on CPU.

On CUDA (``--device cuda``, the default when there is one; Llama-3-8B heads, 32 query / 8 KV heads
of 128, bf16) it measures what cutting documents into CA-tasks costs the kernel: the same documents
run whole, then cut into at most 3 and at most 12 shards per document (each shard a task with its
K/V prefix), and the tail of a long document as 16 shards of 128 queries against 64k-token prefixes.
Every usable CUDA backend runs each workload forward + backward; the table gives milliseconds,
TFLOP/s (``planning.attention_flops`` of the visible pairs, backward counted as 2.5x the forward) and
the efficiency: TFLOP/s over the same backend's on the whole documents.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from ..kernels import available_backends, torch_cpu, varlen_causal_attention
from ..planning import attention_flops, causal_pairs
from .machine_limits import out_of_memory, threads_problem
from .output_paths import output_path_problem

WORKLOADS = {
    # whole documents of a skewed mix, as a rank holds them before planning (8k tokens)
    "mixed_documents": {"docs": [4096, 1024, 1024, 512, 512] + [256] * 4 + [128] * 8, "shard": None},
    # the same documents cut into 512-token CA-tasks, as a server receives them after planning
    "mixed_as_512_shards": {"docs": [4096, 1024, 1024, 512, 512] + [256] * 4 + [128] * 8, "shard": 512},
    # many short documents (8k tokens)
    "short_documents": {"docs": [128] * 64, "shard": None},
}


def _task_shapes(docs, shard):
    shapes = []
    for n in docs:
        step = shard or n
        for start in range(0, n, step):
            end = min(n, start + step)
            shapes.append((end - start, end))
    return shapes


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _sdpa_mask(q, k, v, cu_q, cu_k, scale):
    outs = []
    for i in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        mask = torch.ones(qe - qs, ke - ks, dtype=torch.bool).tril(diagonal=(ke - ks) - (qe - qs))
        o = F.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=True,
        )
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def _dense_packed(q, k, v, docs, scale):
    doc_id = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))
    mask = (doc_id[:, None] == doc_id[None, :]).tril()
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       attn_mask=mask, scale=scale, enable_gqa=True)
    return o.transpose(0, 1)


def _flex_forward(q, k, v, docs, scale):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    doc_id = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))
    total = int(doc_id.numel())
    block_mask = create_block_mask(lambda b, h, qi, ki: (doc_id[qi] == doc_id[ki]) & (ki <= qi), None, None,
                                   total, total, device="cpu")
    compiled = torch.compile(flex_attention, dynamic=False)

    def run():
        with torch.no_grad():
            return compiled(q.detach().transpose(0, 1)[None], k.detach().transpose(0, 1)[None],
                            v.detach().transpose(0, 1)[None], block_mask=block_mask, scale=scale, enable_gqa=True)

    return run


def median_seconds(fn, repeats: int, sync=lambda: None) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs after one warm-up; ``sync`` waits for the
    device (``torch.cuda.synchronize`` on GPU)."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _time(fn, repeats: int) -> float:
    return median_seconds(fn, repeats) * 1e3


CANDIDATES = ("torch_cpu", "torch_cpu_stacked", "sdpa_mask", "math", "dense_packed_sdpa")


def run(heads=8, kv_heads=2, head_dim=64, dtype=torch.float32, repeats=3, flex=False, workloads=None, threads=None,
        candidates=None):
    """Returns ``{workload: {candidate: median milliseconds (forward + backward)}}``."""
    candidates = set(candidates or CANDIDATES)
    sizes = {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "repeats": repeats, "threads": threads}
    for name, value in sizes.items():
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if threads is not None:
        torch.set_num_threads(threads)
    results = {}
    for name in workloads or WORKLOADS:
        spec = WORKLOADS[name]
        shapes = _task_shapes(spec["docs"], spec["shard"])
        cu_q, cu_k = _cu([s[0] for s in shapes]), _cu([s[1] for s in shapes])
        max_q, max_k = max(s[0] for s in shapes), max(s[1] for s in shapes)
        g = torch.Generator().manual_seed(0)
        q = torch.randn(int(cu_q[-1]), heads, head_dim, generator=g).to(dtype).requires_grad_()
        k = torch.randn(int(cu_k[-1]), kv_heads, head_dim, generator=g).to(dtype).requires_grad_()
        v = torch.randn(int(cu_k[-1]), kv_heads, head_dim, generator=g).to(dtype).requires_grad_()
        dout = torch.randn(q.shape, generator=g).to(dtype)
        scale = head_dim**-0.5

        def train_step(forward):
            def step():
                out = forward()
                torch.autograd.grad(out, (q, k, v), dout)

            return step

        def backend(name, group=False):
            def forward():
                default, torch_cpu.GROUP_SAME_SHAPE = torch_cpu.GROUP_SAME_SHAPE, group
                try:
                    return varlen_causal_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale, name)
                finally:
                    torch_cpu.GROUP_SAME_SHAPE = default

            return forward

        steps = {
            "torch_cpu": train_step(backend("torch_cpu")),
            "torch_cpu_stacked": train_step(backend("torch_cpu", group=True)),
            "sdpa_mask": train_step(lambda: _sdpa_mask(q, k, v, cu_q, cu_k, scale)),
            "math": train_step(backend("math")),
        }
        if spec["shard"] is None:  # the dense packed mask describes whole documents only
            steps["dense_packed_sdpa"] = train_step(lambda: _dense_packed(q, k, v, spec["docs"], scale))
        row = {c: _time(fn, repeats) for c, fn in steps.items() if c in candidates}
        if flex and spec["shard"] is None:
            row["flex_attention_forward_only"] = _time(_flex_forward(q, k, v, spec["docs"], scale), repeats)
            with torch.no_grad():
                row["torch_cpu_forward_only"] = _time(backend("torch_cpu"), repeats)
        results[name] = row
    return results


def format_table(results) -> str:
    lines = ["| workload | candidate | fwd+bwd ms | x fastest |", "| --- | --- | ---: | ---: |"]
    for workload, row in results.items():
        trained = {c: t for c, t in row.items() if not c.endswith("forward_only")}
        best = min(trained.values())
        for candidate, ms in sorted(row.items(), key=lambda kv: kv[1]):
            ratio = "fwd only" if candidate.endswith("forward_only") else f"{ms / best:.2f}"
            lines.append(f"| {workload} | {candidate} | {ms:.1f} | {ratio} |")
    return "\n".join(lines)


# --- CUDA: whole documents against the same documents as CA-tasks ------------------------------------

CUDA_DOCS = (32768, 16384, 8192, 8192, 4096, 4096, 2048, 2048, 1024, 1024, 1024, 1024)  # 80k tokens
CUDA_WORKLOADS = {
    # name: (documents, at most this many shards per document; None: whole)
    "whole_documents": (CUDA_DOCS, None),
    "at_most_3_shards": (CUDA_DOCS, 3),
    "at_most_12_shards": (CUDA_DOCS, 12),
    # the last 16 x 128 queries of a 64k-token document, each shard its own task with its prefix
    "16x128_queries_64k_prefix": ((65536,), "tail"),
}
SHARD_ALIGN = 128  # shard boundaries on multiples of the kernels' query tile


def cuda_task_shapes(docs, cut) -> list[tuple[int, int]]:
    """``(lq, lk)`` of each CA-task: documents whole (``cut=None``), cut into at most ``cut`` shards of
    equal size (boundaries on multiples of ``SHARD_ALIGN``), or ``"tail"``: the last 16 shards of
    ``SHARD_ALIGN`` queries of each document."""
    shapes = []
    for n in docs:
        if cut == "tail":
            shapes += [(SHARD_ALIGN, n - SHARD_ALIGN * i) for i in range(16)][::-1]
            continue
        step = n if cut is None else -(-n // (cut * SHARD_ALIGN)) * SHARD_ALIGN
        shapes += [(min(n, start + step) - start, min(n, start + step)) for start in range(0, n, step)]
    return shapes


def run_cuda(heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16, repeats=3, workloads=None, candidates=None,
             window=None, device="cuda"):
    """``{workload: {backend: {"ms", "tflops", "efficiency", "tasks", "pairs"}}}``: forward + backward of
    each workload's CA-tasks with each usable CUDA backend (``candidates``: a subset of them)."""
    device = torch.device(device)
    backends = [b for b in available_backends(device, dtype) if b != "math" and (not candidates or b in candidates)]
    if not backends:
        raise ValueError(f"no fused CUDA kernel backend runs {str(dtype).removeprefix('torch.')} on {device}; "
                         "see `distca-hf env`")
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    results = {}
    for name in workloads or CUDA_WORKLOADS:
        docs, cut = CUDA_WORKLOADS[name]
        shapes = cuda_task_shapes(docs, cut)
        cu_q = _cu([s[0] for s in shapes]).to(device)
        cu_k = _cu([s[1] for s in shapes]).to(device)
        max_q, max_k = max(s[0] for s in shapes), max(s[1] for s in shapes)
        pairs = sum(int(causal_pairs(lk - lq, lk, window)) for lq, lk in shapes)
        flops = attention_flops(pairs, heads, head_dim, backward=True)
        g = torch.Generator(device=device).manual_seed(0)
        make = lambda n, h: torch.randn(n, h, head_dim, generator=g, device=device).to(dtype).requires_grad_()
        q, k, v = make(int(cu_q[-1]), heads), make(int(cu_k[-1]), kv_heads), make(int(cu_k[-1]), kv_heads)
        dout = torch.randn(q.shape, generator=g, device=device).to(dtype)
        row = {}
        for backend in backends:
            def step(backend=backend):
                out = varlen_causal_attention(q, k, v, cu_q, cu_k, max_q, max_k, head_dim**-0.5, backend, window=window)
                torch.autograd.grad(out, (q, k, v), dout)

            seconds = median_seconds(step, repeats, sync)
            row[backend] = {"ms": seconds * 1e3, "tflops": flops / seconds / 1e12, "tasks": len(shapes), "pairs": pairs}
        results[name] = row
        del q, k, v, dout
    whole = results.get("whole_documents", {})
    for row in results.values():
        for backend, r in row.items():
            r["efficiency"] = r["tflops"] / whole[backend]["tflops"] if backend in whole else None
    return results


def format_cuda_table(results) -> str:
    lines = ["| workload | backend | tasks | fwd+bwd ms | TFLOP/s | efficiency vs whole |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for workload, row in results.items():
        for backend, r in row.items():
            eff = "" if r["efficiency"] is None else f"{100 * r['efficiency']:.0f}%"
            lines.append(f"| {workload} | {backend} | {r['tasks']} | {r['ms']:.2f} | {r['tflops']:.0f} | {eff} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The ``distca-hf kernel-bench`` argument parser."""
    parser = argparse.ArgumentParser(prog="distca-hf kernel-bench", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="default: cuda when there is one (CA-task efficiency), else cpu (exact CPU paths)")
    parser.add_argument("--heads", type=int, default=None, help="query heads (default: 32 on cuda, 8 on cpu)")
    parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads, a divisor of --heads (default: "
                        "8 on cuda, 2 on cpu)")
    parser.add_argument("--head-dim", type=int, default=None, help="elements per head (default: 128 on cuda, 64 on "
                        "cpu)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per kernel and workload after one "
                        "warm-up; the median is reported (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--workload", action="append", choices=sorted({*WORKLOADS, *CUDA_WORKLOADS}),
                        help="a workload to time (repeatable; default: all of the device's)")
    parser.add_argument("--candidate", action="append", choices=sorted({*CANDIDATES, "flash_attn", "torch_cuda",
                                                                        "torch_cuda_efficient"}),
                        help="a kernel backend to time (repeatable; default: all of the device's)")
    parser.add_argument("--window", type=int, default=None, help="cuda: a sliding window in keys per query "
                        "(HF's sliding_window; default: none)")
    parser.add_argument("--flex", action="store_true", help="cpu: also time compiled flex attention (forward only)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--out", default=None, help="also write the results as JSON to this file (a path)")
    return parser


MAX_SHAPE = 4096
"""The most heads, key/value heads, head dimension or repeats a run takes (today's models use at most a
few hundred heads of up to 256 dimensions)."""


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    for flag in ("heads", "kv_heads", "head_dim", "repeats", "threads"):  # (None: the default)
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
        if flag != "threads" and value is not None and value > MAX_SHAPE:  # overflowed in torch.randn before
            parser.error(f"--{flag.replace('_', '-')} must be at most {MAX_SHAPE}, got {value}")
    problem = threads_problem(args.threads) if args.threads is not None else None
    if problem:
        parser.error(problem)
    problem = output_path_problem("--out", args.out) if args.out is not None else None
    if problem:
        parser.error(problem)
    heads = args.heads if args.heads is not None else (32 if cuda else 8)
    kv_heads = args.kv_heads if args.kv_heads is not None else (8 if cuda else 2)
    head_dim = args.head_dim if args.head_dim is not None else (128 if cuda else 64)
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    if heads % kv_heads:
        parser.error(f"--heads ({heads}) must be a multiple of --kv-heads ({kv_heads})")
    if args.window is not None and args.window < 1:
        parser.error("--window must be a positive number of keys")
    known = CUDA_WORKLOADS if cuda else WORKLOADS
    wrong = [w for w in args.workload or () if w not in known]
    if wrong:
        parser.error(f"--workload {wrong[0]} is not a {device} workload; choose from {sorted(known)}")
    if cuda:
        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device")
        if args.flex or args.threads is not None:
            parser.error(f"{'--flex' if args.flex else '--threads'} is a cpu option")
        try:
            results = run_cuda(heads, kv_heads, head_dim, dtype, args.repeats, args.workload, args.candidate, args.window)
        except ValueError as e:
            parser.error(str(e))
        table = format_cuda_table(results)
        name = torch.cuda.get_device_name()
        header = f"{name}, torch {torch.__version__}, {str(dtype).removeprefix('torch.')}, {heads}/{kv_heads} heads of {head_dim}"
        print(json.dumps(results, indent=2) if args.json else f"{header}\n\n{table}")
        _write(args.out, {"device": name, "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."),
                          "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "window": args.window,
                          "results": results})
        return 0
    if args.window is not None:
        parser.error("--window is a cuda option")
    foreign = [c for c in args.candidate or () if c not in CANDIDATES]
    if foreign:
        parser.error(f"--candidate {foreign[0]} is not a cpu candidate; choose from {list(CANDIDATES)} (or --device cuda)")
    sharded = [w for w in args.workload or () if WORKLOADS[w]["shard"] is not None]
    whole = sorted(w for w, spec in WORKLOADS.items() if spec["shard"] is None)
    if sharded and args.flex:  # (nothing was timed, without a word)
        parser.error(f"--flex times whole-document workloads only ({', '.join(whole)}); {sharded[0]} is cut into "
                     "shards")
    if sharded and "dense_packed_sdpa" in (args.candidate or ()):  # (an empty table's traceback)
        parser.error(f"--candidate dense_packed_sdpa masks whole documents only ({', '.join(whole)}); it cannot "
                     f"time {sharded[0]}")
    try:
        results = run(heads, kv_heads, head_dim, dtype, args.repeats, args.flex, args.workload, args.threads,
                      list(args.candidate or CANDIDATES))
    except (RuntimeError, MemoryError) as e:  # (torch's allocator traceback before)
        if not out_of_memory(e):
            raise
        parser.error(f"--heads {heads} --kv-heads {kv_heads} --head-dim {head_dim}: out of memory "
                     f"({str(e).splitlines()[0][:160]}); lower them")
    print(json.dumps(results, indent=2) if args.json else format_table(results))
    _write(args.out, {"device": "cpu", "torch": torch.__version__, "results": results})
    return 0


def _write(path, payload) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)
