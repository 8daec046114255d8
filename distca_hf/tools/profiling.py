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

Communication (``bytes_per_s`` and ``collective_s``, which ``tolerance="auto"`` weighs against the
balance) needs several processes. Without ``--world`` it is not measured: the two terms are the
device kind's built-in model's (``planning.default_time_model``) and the ``source`` says so. With
``--world N`` the profile spawns N processes (gloo on CPU; NCCL with one GPU each when there are N
GPUs, else gloo over CUDA tensors) and runs one attention layer, forward + backward, through the
dispatch the HF attention function uses (``runtime.build_dispatch`` + ``runtime.dispatched_attention``:
packing, the all-to-alls, unpacking) under synthetic plans that give every server the same kernel
work while moving different amounts of queries and K/V (``communication_plans``). A layer's cost
beyond its kernels is its time minus that of the colocated plan with the same kernel work (which
runs no collective); ``fit_comm_terms`` fits ``extra = collective_s + 2 (sent + received) /
bytes_per_s`` over the plans, with the slowest rank's time and bytes per layer.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

from ..kernels import select_backend, varlen_causal_attention
from ..planning import (DocumentPieces, PackedDocuments, Plan, TimeModel, TokenBytes, causal_pairs,
                        default_time_model)
from ..planning.transfers import rank_bytes
from ..runtime import dispatched_attention
from ..runtime.comm import free_port
from ..runtime.dispatch import build_dispatch
from ..runtime.tables import LocalDocuments
from .kernel_bench import median_seconds
from .machine_limits import out_of_memory, world_problem
from .output_paths import output_path_problem

__all__ = ["profile", "build_parser", "main", "COMM_DOCUMENTS", "COMM_TINY_TOKENS", "CommPlans",
           "communication_plans", "CommFit", "fit_comm_terms", "comm_backend", "world_warning", "CommMeasurement",
           "measure_communication"]


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
            token_counts=(256, 512, 1024, 2048), *, world: int | None = None) -> TimeModel:
    """The measured ``TimeModel``. ``world``: also measure ``bytes_per_s`` and ``collective_s`` on
    that many processes (``measure_communication`` at ``max(token_counts)`` tokens per rank); ``None``
    keeps the built-in model's communication terms."""
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
    token_bytes = TokenBytes.for_model(hidden, heads, kv_heads, dtype_bytes)
    builtin = default_time_model(device.type, token_bytes, dtype_bytes)
    bytes_per_s, collective_s = builtin.bytes_per_s, builtin.collective_s
    comm_source = (f"bytes_per_s and collective_s not measured (one process): the built-in "
                   f"{'CUDA' if device.type == 'cuda' else 'CPU'} model's (--world N measures them)")
    if world is not None:
        measured = measure_communication(world=world, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                                         device_type=device.type, tokens=largest, rounds=max(5, 3 * repeats),
                                         fallback_bytes_per_s=builtin.bytes_per_s)
        bytes_per_s, collective_s, comm_source = measured.fit.bytes_per_s, measured.fit.collective_s, measured.source
    return TimeModel(
        linear_s_per_token=max(float(slope), 0.0),
        attn_s_per_pair=max(float(per_pair), 0.0),
        task_s=max(float(per_task), 0.0),
        bytes_per_s=bytes_per_s,
        collective_s=collective_s,
        source=f"distca-hf profile on {where}, torch {torch.__version__}, {str(dtype).removeprefix('torch.')}, "
               f"kernel {backend}; {comm_source}",
        **extra,
    )


# --- communication: plans, the per-rank worker, the fit --------------------------------------------

COMM_DOCUMENTS = 16
"""Documents of equal length per rank in the communication plans (besides the tiny one)."""
COMM_TINY_TOKENS = 4
"""The tiny document every moving plan moves: the plan that moves only it isolates ``collective_s``."""


@dataclasses.dataclass(frozen=True, eq=False)
class CommPlans:
    """Synthetic plans for measuring communication (``communication_plans``).

    Attributes:
        lengths: ``[documents]`` int64 tokens of each document of a rank, the same on every rank: the
            tiny one, then ``COMM_DOCUMENTS`` of equal length.
        pieces: every rank's documents (rank ``r``'s document ``j`` has global id ``r * documents + j``).
        names: a name per plan; the first (``"colocated"``) moves nothing and is the kernel-only reference.
        plans: the plans, each cutting every long document into the same two tasks (head and tail
            halves), so every server computes the same task shapes under every plan.
    """

    lengths: np.ndarray
    pieces: DocumentPieces
    names: tuple
    plans: tuple

    def global_ids(self, rank: int) -> np.ndarray:
        return rank * self.lengths.size + np.arange(self.lengths.size, dtype=np.int64)


def communication_plans(world: int, tokens: int) -> CommPlans:
    """Plans over ``world`` ranks of about ``tokens`` tokens each that move different amounts of
    queries and K/V while giving every server the same kernel work.

    Every rank holds the same documents: ``COMM_TINY_TOKENS`` tokens, then ``COMM_DOCUMENTS`` of
    ``tokens // COMM_DOCUMENTS`` each, cut into a head and a tail task. A plan moves, from every rank,
    the tiny document, the heads of its first ``h`` long documents and the tails of its first ``t``;
    the tasks of document ``j`` go to rank ``(r + 1 + j mod (world - 1)) mod world`` (a shift, so
    every server gets exactly one copy of each moved task: the kernel work of the colocated plan).
    A head moves queries and K/V alike; a tail moves its queries and the whole K/V prefix; a head and
    tail of one document send its K/V once."""
    if world < 2:
        raise ValueError(f"communication plans need at least 2 ranks, got {world}")
    length = tokens // COMM_DOCUMENTS
    if length < 2:
        raise ValueError(f"tokens per rank must be at least {2 * COMM_DOCUMENTS} (two tokens per document), "
                         f"got {tokens}")
    lengths = np.array([COMM_TINY_TOKENS] + [length] * COMM_DOCUMENTS, dtype=np.int64)
    n, half = lengths.size, length // 2
    rank = np.repeat(np.arange(world), n)
    pieces = DocumentPieces(rank, np.arange(world * n), np.zeros(world * n, np.int64), np.tile(lengths, world), world)
    docs = COMM_DOCUMENTS
    moves = [("colocated", False, 0, 0), ("tiny document", True, 0, 0), ("1 document", True, 1, 1),
             (f"{docs // 4} heads", True, docs // 4, 0), (f"{docs // 2} tails", True, 0, docs // 2),
             (f"{docs // 4} documents", True, docs // 4, docs // 4),
             (f"{docs // 2} documents", True, docs // 2, docs // 2), (f"{docs} documents", True, docs, docs)]
    plans = []
    for _, tiny, heads, tails in moves:
        rows = []  # (source, server, doc, q_start, q_end)
        for r in range(world):
            away = (r + 1 + np.arange(n) % (world - 1)) % world  # where document j's moved tasks go
            rows.append((r, away[0] if tiny else r, r * n, 0, COMM_TINY_TOKENS))
            for j in range(1, n):
                rows.append((r, away[j] if j <= heads else r, r * n + j, 0, half))
                rows.append((r, away[j] if j <= tails else r, r * n + j, half, length))
        source, server, doc, q_start, q_end = np.asarray(rows, dtype=np.int64).T
        order = np.lexsort((q_start, doc, source, server))  # the planner's order: by server, then source
        plans.append(Plan(source[order], server[order], doc[order], q_start[order], q_end[order], world,
                          tuple(range(world))))
    return CommPlans(lengths, pieces, tuple(m[0] for m in moves), tuple(plans))


@dataclasses.dataclass(frozen=True)
class CommFit:
    """``bytes_per_s`` (bytes a rank sends plus receives per second) and ``collective_s`` (seconds
    of a layer, forward + backward, that moves anything), and what replaced a non-positive fit."""

    bytes_per_s: float
    collective_s: float
    warnings: tuple = ()


def fit_comm_terms(layer_bytes, extra_seconds, *, fallback_bytes_per_s: float) -> CommFit:
    """Least squares of ``extra_seconds = collective_s + 2 * layer_bytes / bytes_per_s`` (the time
    model's ``comm_seconds``). ``layer_bytes``: ``[plans]`` bytes the slowest rank sends plus
    receives in one layer's forward (the backward moves as many again, hence the 2);
    ``extra_seconds``: ``[plans]`` seconds of a layer, forward + backward, beyond its kernels.

    A fit that is not positive is replaced, with a warning in ``warnings``: a negative
    ``collective_s`` by 0 and ``bytes_per_s`` refitted through the origin; a ``bytes_per_s`` that is
    not positive (the time does not grow with the bytes) by ``fallback_bytes_per_s``, with
    ``collective_s`` the least-squares intercept given it (at least 0)."""
    x = 2.0 * np.asarray(layer_bytes, dtype=np.float64).reshape(-1)
    t = np.asarray(extra_seconds, dtype=np.float64).reshape(-1)
    if x.shape != t.shape:
        raise ValueError(f"layer_bytes and extra_seconds must have one entry per plan, got {x.size} and {t.size}")
    if not (np.isfinite(x).all() and np.isfinite(t).all()) or (x < 0).any():
        raise ValueError("layer_bytes must be finite and >= 0, extra_seconds finite")
    if np.unique(x).size < 2:
        raise ValueError("the fit needs plans that move at least two different amounts of bytes")
    if not (fallback_bytes_per_s > 0 and np.isfinite(fallback_bytes_per_s)):
        raise ValueError(f"fallback_bytes_per_s must be a positive number, got {fallback_bytes_per_s!r}")
    scale = x.max()  # a column of order 1 keeps the least-squares problem well conditioned
    (intercept, per_scaled), *_ = np.linalg.lstsq(np.stack([np.ones_like(x), x / scale], axis=1), t, rcond=None)
    seconds_per_byte = per_scaled / scale
    if seconds_per_byte > 0 and intercept >= 0:
        return CommFit(float(1.0 / seconds_per_byte), float(intercept))
    if seconds_per_byte > 0:
        through_origin = float(x @ t / (x @ x))
        if through_origin > 0:
            return CommFit(1.0 / through_origin, 0.0, (
                f"collective_s fitted negative ({intercept * 1e3:.3g} ms): the fixed cost of a layer is below what "
                "these timings resolve; collective_s set to 0 and bytes_per_s refitted through the origin",))
    collective_s = max(float(np.mean(t - x / fallback_bytes_per_s)), 0.0)
    return CommFit(float(fallback_bytes_per_s), collective_s, (
        f"bytes_per_s not resolved (the time beyond the kernels does not grow with the bytes moved: "
        f"{seconds_per_byte:.3g} s per byte); kept the built-in {_rate(fallback_bytes_per_s)} and fitted "
        f"collective_s = {collective_s * 1e3:.3g} ms given it",))


def comm_backend(device_type: str, world: int, gpus: int) -> tuple[str, str]:
    """``(backend, description)`` of the processes measuring communication: gloo on CPU; on CUDA,
    NCCL with one GPU per process when there are ``world`` GPUs, else gloo over CUDA tensors
    (processes sharing GPUs; not what NCCL on a cluster moves)."""
    if device_type != "cuda":
        return "gloo", f"{world} gloo processes on CPU"
    if gpus >= world:
        return "nccl", f"{world} NCCL processes, one GPU each"
    return "gloo", (f"{world} gloo processes with CUDA tensors on {gpus} GPU(s) (fewer GPUs than --world, so not "
                    "NCCL: a lower bound on the rate NCCL would reach)")


def world_warning(world: int, device_type: str, cpus: int) -> str | None:
    """A warning when ``world`` processes are more than this machine runs side by side (CPU processes
    beyond its cores take turns, and the measured latency includes the turns)."""
    if device_type != "cuda" and world > cpus:
        return (f"distca-hf profile: --world {world} starts more processes than this machine's {cpus} CPU core(s); "
                "they take turns on the cores, which the measured collective_s includes")
    return None


@dataclasses.dataclass(frozen=True, eq=False)
class CommMeasurement:
    """What ``measure_communication`` measured.

    Attributes:
        names: ``[plans]`` the moving plans' names.
        layer_bytes: ``[plans]`` bytes the slowest rank sends plus receives in one layer's forward.
        extra_seconds: ``[plans]`` median over rounds of the slowest rank's layer time (forward +
            backward) minus the colocated plan's in the same round.
        colocated_seconds: median layer time of the colocated plan (its kernels and gathers).
        round_seconds: ``[rounds, 1 + plans]`` the slowest rank's layer time, colocated first.
        fit: the fitted terms.
        source: where the terms come from, for ``TimeModel.source``.
    """

    names: tuple
    layer_bytes: np.ndarray
    extra_seconds: np.ndarray
    colocated_seconds: float
    round_seconds: np.ndarray
    fit: CommFit
    source: str


def measure_communication(*, world: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                          device_type: str, tokens: int, rounds: int, fallback_bytes_per_s: float,
                          timeout_s: float = 300.0) -> CommMeasurement:
    """Spawn ``world`` processes (``comm_backend``), time one attention layer, forward + backward,
    through the dispatch under every plan of ``communication_plans(world, tokens)`` in ``rounds``
    rounds (plans in a fresh order each round, after one warm-up call each), and fit the
    communication terms (``fit_comm_terms``); q ``[tokens, heads, head_dim]``, k/v ``[tokens,
    kv_heads, head_dim]`` in ``dtype``."""
    import torch.multiprocessing as mp

    gpus = torch.cuda.device_count() if device_type == "cuda" else 0
    backend, description = comm_backend(device_type, world, gpus)
    token_bytes = _token_bytes(heads, kv_heads, head_dim, dtype)
    settings = {"backend": backend, "device_type": device_type, "dtype": str(dtype).removeprefix("torch."),
                "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "tokens": tokens,
                "rounds": rounds, "timeout_s": timeout_s,
                "threads": max(1, (os.cpu_count() or 1) // world) if device_type != "cuda" else None}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "communication.json")
        mp.start_processes(_comm_worker, args=(world, settings, free_port(), path), nprocs=world,
                           start_method="spawn")
        with open(path) as f:
            seconds = np.asarray(json.load(f)["seconds"], dtype=np.float64)  # [rounds, plans], slowest rank
    plans = communication_plans(world, tokens)
    layer_bytes = np.array([max(s + r for s, r in zip(*rank_bytes(p, plans.pieces, token_bytes)))
                            for p in plans.plans[1:]], dtype=np.float64)
    extra = np.median(seconds[:, 1:] - seconds[:, :1], axis=0)
    fit = fit_comm_terms(layer_bytes, extra, fallback_bytes_per_s=fallback_bytes_per_s)
    for warning in fit.warnings:
        print(f"distca-hf profile: warning: {warning}", file=sys.stderr)
    threads = f", {settings['threads']} torch thread(s) each" if settings["threads"] else ""
    source = (f"bytes_per_s and collective_s measured through the dispatch on {description}{threads}: "
              f"{len(plans.plans) - 1} plans moving {_size(layer_bytes.min())} to {_size(layer_bytes.max())} per "
              f"rank and layer, time beyond the colocated plan's kernels (median of {rounds} rounds) fitted as "
              f"collective_s + 2 (sent + received) / bytes_per_s"
              + "".join(f"; {w}" for w in fit.warnings))
    return CommMeasurement(plans.names[1:], layer_bytes, extra, float(np.median(seconds[:, 0])), seconds, fit, source)


def _comm_worker(rank: int, world: int, settings: dict, port: int, result_path: str) -> None:
    """One process of ``measure_communication``: times every plan's layer and, on rank 0, writes
    ``{"seconds": [rounds][plans]}``, each the slowest rank's."""
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    if settings["threads"]:
        torch.set_num_threads(settings["threads"])
    if settings["device_type"] == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
        sync = torch.cuda.synchronize
    else:
        device, sync = torch.device("cpu"), (lambda: None)
    backend = settings["backend"]
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=settings["timeout_s"]))
    try:
        seconds = _time_plans(rank, world, settings, device, sync)
        reduce_on = device if backend == "nccl" else torch.device("cpu")
        slowest = torch.tensor(seconds, dtype=torch.float64, device=reduce_on)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump({"seconds": slowest.cpu().tolist()}, f)
    finally:
        dist.destroy_process_group()


def _time_plans(rank: int, world: int, settings: dict, device, sync) -> list[list[float]]:
    """``[rounds][plans]`` this rank's seconds of one layer, forward + backward, per plan."""
    import torch.distributed as dist

    plans = communication_plans(world, settings["tokens"])
    heads, kv_heads, head_dim = settings["heads"], settings["kv_heads"], settings["head_dim"]
    dtype = getattr(torch, settings["dtype"])
    token_bytes = _token_bytes(heads, kv_heads, head_dim, dtype)
    local = LocalDocuments(PackedDocuments.from_lengths(plans.lengths), plans.global_ids(rank),
                           np.zeros(plans.lengths.size, dtype=np.int64))
    dispatches = [build_dispatch(p, plans.pieces, local, rank, device, group=None, timeout_s=settings["timeout_s"],
                                 backward_mode="saved") for p in plans.plans]
    tokens = int(plans.lengths.sum())
    generator = torch.Generator().manual_seed(rank)
    make = lambda h: torch.randn(tokens, h, head_dim, generator=generator).to(device, dtype)
    q, k, v, dout = make(heads), make(kv_heads), make(kv_heads), make(heads)
    for t in (q, k, v):
        t.requires_grad_(True)
    meet = torch.zeros(1, device=device if settings["backend"] == "nccl" else "cpu")

    def layer(dispatch):
        out = dispatched_attention(q, k, v, dispatch, head_dim**-0.5)
        torch.autograd.grad(out, (q, k, v), dout)

    for p, dispatch in zip(plans.plans, dispatches):
        layer(dispatch)  # warm-up: buffers, kernels
        sent, received = rank_bytes(p, plans.pieces, token_bytes)
        moved = sum(dispatch.counters.bytes_sent.values())
        # the backward sends what the forward received (dO for the returned O, dQ/dK/dV for what came in)
        if moved != sent[rank] + received[rank]:
            raise AssertionError(f"distca-hf profile: the dispatch sent {moved} bytes where the plan's byte count "
                                 f"says {sent[rank] + received[rank]}; please report this")
    seconds = []
    for round_ in range(settings["rounds"]):
        # a fresh order each round (the same on every rank), the colocated reference first
        order = [0] + (1 + np.random.default_rng(round_).permutation(len(dispatches) - 1)).tolist()
        row = [0.0] * len(dispatches)
        for i in order:
            dist.all_reduce(meet)  # start together: the slowest rank's time is the layer's
            sync()
            start = time.perf_counter()
            layer(dispatches[i])
            sync()
            row[i] = time.perf_counter() - start
        seconds.append(row)
    return seconds


def _token_bytes(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> TokenBytes:
    return TokenBytes.for_model(heads * head_dim, heads, kv_heads, torch.empty(0, dtype=dtype).element_size(), head_dim)


def _size(n: float) -> str:
    return f"{n / 1e6:.3g} MB" if n >= 1e5 else f"{n / 1e3:.3g} kB"


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.3g} GB/s" if bytes_per_s >= 1e9 else f"{bytes_per_s / 1e6:.3g} MB/s"


def build_parser() -> argparse.ArgumentParser:
    """The ``distca-hf profile`` argument parser."""
    parser = argparse.ArgumentParser(prog="distca-hf profile", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="distca_time_model.json", help="where to write the JSON (a path; default: "
                        "%(default)s)")
    parser.add_argument("--hidden", type=int, default=512, help="the timed layer's hidden size, elements per token "
                        "(default: %(default)s)")
    parser.add_argument("--intermediate", type=int, default=1408, help="the timed layer's MLP intermediate size, "
                        "elements per token (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=8, help="query heads (default: %(default)s)")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads, a divisor of --heads (default: "
                        "%(default)s)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--device", default=None, help="a torch device such as cpu, cuda, cuda:1 (default: cuda if "
                        "available, else cpu)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement after one warm-up; the "
                        "median is kept (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=None, help="largest token count timed, tokens (default: 16384 on "
                        "cuda, 2048 on cpu); with --world, also the tokens per process")
    parser.add_argument("--world", type=int, default=None,
                        help="also measure bytes_per_s and collective_s on this many processes (>= 2; gloo on CPU, "
                        "NCCL on as many GPUs): one attention layer through the dispatch under plans moving different "
                        "amounts, median of 3 x --repeats rounds (at least 5); default: not measured, the built-in "
                        "model's")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ("hidden", "intermediate", "heads", "kv_heads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        parser.error("--hidden must be a multiple of --heads, and --heads a multiple of --kv-heads")
    if args.world is not None and args.world < 2:
        parser.error(f"--world must be >= 2 (processes that exchange the dispatch's data), got {args.world}; leave it "
                     "out to keep the built-in communication terms")
    device = args.device if args.device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        kind = torch.device(device).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda") or (kind == "cpu" and torch.device(device).index not in (None, 0)):
        parser.error(f"--device must be cpu, cuda or cuda:N, got {device!r}")  # (cpu:5 named no device)
    if device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {device}: torch sees no CUDA device")
    if kind == "cuda" and (torch.device(device).index or 0) >= torch.cuda.device_count():
        parser.error(f"--device {device}: torch sees {torch.cuda.device_count()} CUDA devices (cuda:0 to "
                     f"cuda:{torch.cuda.device_count() - 1})")
    if args.max_tokens is None:
        args.max_tokens = 16384 if device.startswith("cuda") else 2048
    if args.max_tokens < 64:
        parser.error(f"--max-tokens must be >= 64, got {args.max_tokens}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    problem = world_problem(args.world) if args.world is not None else None
    if problem:
        parser.error(problem)
    problem = output_path_problem("--out", args.out)
    if problem:
        parser.error(problem)
    if args.world is not None:
        warning = world_warning(args.world, torch.device(device).type, os.cpu_count() or 1)
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.startswith("cuda") else "float32"))
    counts = tuple(args.max_tokens // d for d in (8, 4, 2, 1))
    try:
        model = profile(args.hidden, args.intermediate, args.heads, args.kv_heads, dtype, device, args.repeats, counts,
                        world=args.world)
    except (RuntimeError, MemoryError) as e:  # (torch's allocator traceback before)
        if not out_of_memory(e):
            raise
        parser.error(f"--max-tokens {args.max_tokens} --hidden {args.hidden} --intermediate {args.intermediate} "
                     f"--heads {args.heads}: out of memory on {device} ({str(e).splitlines()[0][:160]}); lower them")
    model.save(args.out, shape={"hidden": args.hidden, "intermediate": args.intermediate, "heads": args.heads,
                                "kv_heads": args.kv_heads})
    keys = f", {model.task_key_s * 1e9:.3f} ns per task K/V token" if hasattr(model, "task_key_s") else ""
    print(f"linear {model.linear_s_per_token * 1e6:.3f} us/token, attention {model.attn_s_per_pair * 1e9:.4f} ns/pair"
          f"{keys}, task {model.task_s * 1e6:.1f} us ({model.source}); written to {args.out}")
    if args.world is not None:
        print(f"communication on {args.world} processes: bytes_per_s {_rate(model.bytes_per_s)} (sent + received), "
              f"collective_s {model.collective_s * 1e3:.3g} ms per layer (forward + backward)")
    return 0
