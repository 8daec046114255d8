"""Side-by-side timing of the exact CPU paths for a fused batch of CA-tasks (``distca-hf kernel-bench``).

Every candidate computes the same bottom-right causal attention, forward + backward, on the same
tensors; the table reports milliseconds and the ratio to the fastest. The ``torch_cpu`` backend is
the default because it wins here. Candidates:

- ``torch_cpu``: the backend (CPU flash kernel, diagonal/prefix split, one call per task);
- ``torch_cpu_stacked``: the same kernel with same-shape tasks stacked into one call;
- ``sdpa_mask``: ``F.scaled_dot_product_attention`` per task with an explicit bottom-right mask;
- ``math``: the plain-torch backend;
- ``dense_packed_sdpa``: one SDPA over the whole packed batch with a ``[T, T]`` document mask,
  which is what HF's ``sdpa`` does on packed input (cost independent of document lengths);
- ``flex_attention`` (``--flex``): compiled, forward only: torch has no flex backward on CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from ..kernels import torch_cpu, varlen_causal_attention

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
    if threads:
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="distca-hf kernel-bench", description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--workload", action="append", choices=sorted(WORKLOADS), help="repeatable; default all")
    parser.add_argument("--candidate", action="append", choices=CANDIDATES, help="repeatable; default all")
    parser.add_argument("--flex", action="store_true", help="also time compiled flex attention (forward only)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    if args.heads % args.kv_heads:
        parser.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    results = run(args.heads, args.kv_heads, args.head_dim, getattr(torch, args.dtype), args.repeats, args.flex,
                  args.workload, args.threads, args.candidate)
    print(json.dumps(results, indent=2) if args.json else format_table(results))
    return 0
