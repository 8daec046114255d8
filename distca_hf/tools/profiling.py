"""``distca-hf profile``: measure the time model's constants on this device.

Linear cost per token: one Llama-style layer without core attention (RMSNorms, q/k/v/o projections,
gated MLP), forward + backward, timed at several token counts; the slope of a least-squares line.
Attention cost per pair, per K/V token of a task and per task: the selected varlen kernel (on CUDA
``torch_cuda`` for bf16, ``torch_cuda_efficient`` for fp32), forward + backward, on fused batches of
whole documents and of thin shards (128 queries) against long prefixes, which vary pairs, keys and
tasks independently; a least-squares fit of ``time = attn_s_per_pair * pairs + task_key_s * keys +
task_s * tasks + c`` (``task_key_s`` where ``TimeModel`` has it). On CUDA the defaults time up to
16k tokens (2k on CPU), so that launch overheads do not hide the slopes. The JSON it writes is what
``distca-hf simulate --time-model`` (and the planner's callers) load with ``TimeModel.load``.
Communication is not measured here (one process): ``bytes_per_s`` and ``collective_s``, which
``tolerance="auto"`` weighs against the balance, come from the device kind's built-in model
(``planning.default_time_model``); edit them in the JSON if your interconnect differs.
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import torch

from ..kernels import select_backend, varlen_causal_attention
from ..planning import TimeModel, TokenBytes, causal_pairs, default_time_model
from .kernel_bench import median_seconds

__all__ = ["profile", "main"]


class _LinearPart(torch.nn.Module):
    """A decoder layer minus core attention: what scales with tokens."""

    def __init__(self, hidden, intermediate, heads, kv_heads):
        super().__init__()
        head_dim = hidden // heads
        self.norm1, self.norm2 = torch.nn.RMSNorm(hidden), torch.nn.RMSNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.o = torch.nn.Linear(heads * head_dim, hidden, bias=False)
        self.gate_up = torch.nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = torch.nn.Linear(intermediate, hidden, bias=False)
        self.q_width = heads * head_dim

    def forward(self, x):
        qkv = self.qkv(self.norm1(x))
        x = x + self.o(qkv[..., : self.q_width])  # stands in for attention's output
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(torch.nn.functional.silu(gate) * up)


def profile(hidden=512, intermediate=1408, heads=8, kv_heads=2, dtype=torch.float32, device="cpu", repeats=3,
            token_counts=(256, 512, 1024, 2048)) -> TimeModel:
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)

    layer = _LinearPart(hidden, intermediate, heads, kv_heads).to(device, dtype)
    linear_times = []
    for n in token_counts:
        x = torch.randn(n, hidden, device=device, dtype=dtype, requires_grad=True)
        linear_times.append(median_seconds(lambda: layer(x).sum().backward(), repeats, sync))
    slope, _ = np.polyfit(np.asarray(token_counts, dtype=np.float64), linear_times, 1)
    if slope <= 0:  # timings too small to resolve a slope: the average cost is an upper bound
        slope = linear_times[-1] / token_counts[-1]

    head_dim = hidden // heads
    rows, targets = [], []
    largest = max(token_counts)
    shard = min(128, largest // 8)
    batches = [[(max(1, n // docs), max(1, n // docs))] * docs
               for n in (largest // 8, largest // 4, largest // 2, largest) for docs in (1, 4)]
    # thin shards against long prefixes: few pairs per K/V token, what a cut document's tail looks like
    batches += [[(shard, n)] * 4 for n in (largest // 4, largest)]
    for shapes in batches:
        lq, lk = [s[0] for s in shapes], [s[1] for s in shapes]
        cu_q = torch.tensor([0, *np.cumsum(lq).tolist()], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, *np.cumsum(lk).tolist()], dtype=torch.int32, device=device)
        q = torch.randn(sum(lq), heads, head_dim, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(sum(lk), kv_heads, head_dim, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(sum(lk), kv_heads, head_dim, device=device, dtype=dtype, requires_grad=True)
        step = lambda: varlen_causal_attention(q, k, v, cu_q, cu_k, max(lq), max(lk)).sum().backward()
        targets.append(median_seconds(step, repeats, sync))
        rows.append([sum(causal_pairs(b - a, b) for a, b in shapes), sum(lk), len(shapes), 1.0])
    keys_fitted = "task_key_s" in {f.name for f in dataclasses.fields(TimeModel)}
    design = np.asarray(rows, dtype=np.float64)
    if not keys_fitted:
        design = design[:, [0, 2, 3]]
    fit, *_ = np.linalg.lstsq(design, np.asarray(targets), rcond=None)
    per_pair, per_key, per_task = (fit[0], fit[1], fit[2]) if keys_fitted else (fit[0], 0.0, fit[1])
    if per_pair <= 0:
        per_pair = targets[6] / rows[6][0]  # the largest document, whole
    backend = select_backend(device, dtype).NAME
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{torch.get_num_threads()} threads"
    extra = {"task_key_s": max(float(per_key), 0.0)} if keys_fitted else {}
    dtype_bytes = torch.empty(0, dtype=dtype).element_size()
    builtin = default_time_model(device.type, TokenBytes.for_model(hidden, heads, kv_heads, dtype_bytes), dtype_bytes)
    return TimeModel(
        linear_s_per_token=max(float(slope), 0.0),
        attn_s_per_pair=max(float(per_pair), 0.0),
        task_s=max(float(per_task), 0.0),
        bytes_per_s=builtin.bytes_per_s,
        collective_s=builtin.collective_s,
        source=f"distca-hf profile on {where}, torch {torch.__version__}, {str(dtype).removeprefix('torch.')}, "
               f"kernel {backend}",
        **extra,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="distca-hf profile", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="distca_time_model.json", help="where to write the JSON")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=None, help="largest token count timed (default: 16384 on "
                        "cuda, 2048 on cpu)")
    args = parser.parse_args(argv)
    if args.hidden % args.heads or args.heads % args.kv_heads:
        parser.error("--hidden must be a multiple of --heads, and --heads a multiple of --kv-heads")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {device}: torch sees no CUDA device")
    args.max_tokens = args.max_tokens or (16384 if device.startswith("cuda") else 2048)
    if args.max_tokens < 64 or args.repeats < 1:
        parser.error("--max-tokens must be >= 64 and --repeats >= 1")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.startswith("cuda") else "float32"))
    counts = tuple(args.max_tokens // d for d in (8, 4, 2, 1))
    model = profile(args.hidden, args.intermediate, args.heads, args.kv_heads, dtype, device, args.repeats, counts)
    model.save(args.out, shape={"hidden": args.hidden, "intermediate": args.intermediate, "heads": args.heads,
                                "kv_heads": args.kv_heads})
    keys = f", {model.task_key_s * 1e9:.3f} ns per task K/V token" if hasattr(model, "task_key_s") else ""
    print(f"linear {model.linear_s_per_token * 1e6:.3f} us/token, attention {model.attn_s_per_pair * 1e9:.4f} ns/pair"
          f"{keys}, task {model.task_s * 1e6:.1f} us ({model.source}); written to {args.out}")
    return 0
