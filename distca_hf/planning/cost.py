"""Cost of core attention: query-key pairs, FLOPs, bytes on the wire and time. One home per formula.

Units: pairs are (query token, key token) couples that the causal mask keeps; FLOPs count a
multiply-add as 2; bytes are per token and layer forward; times are seconds of one layer, forward +
backward. ``TimeModel`` turns tokens, pairs and task counts into time; ``distca-hf profile``
measures its constants on a device.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

import numpy as np

from ..config import file_version, is_integer, is_number

__all__ = ["causal_pairs", "document_pairs", "key_start", "tile_pairs", "start_with_pairs", "end_with_pairs", "imbalance", "attention_flops", "TokenBytes",
           "LLAMA3_8B_BYTES", "COMM_PASSES", "TimeModel", "LLAMA3_8B_H100", "LLAMA3_8B_SHAPE", "H100_MEASURED",
           "CPU_GLOO_MEASURED", "default_time_model", "resolve_time_model", "check_document_lengths",
           "check_number", "check_time_model"]


def check_window(window) -> int | None:
    """A sliding attention ``window`` as given to the planners: ``None`` (full causal) or an int >= 1
    (numpy integers too), anything else refused naming ``window``."""
    if window is None:
        return None
    if isinstance(window, (bool, np.bool_)) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ValueError(f"window must be None or an integer >= 1 (tokens a query sees), got {window!r}")
    return int(window)


def check_number(value, name: str, *, low: float = 0.0, high: float = math.inf, unit: str = "") -> float:
    """``value`` as a float when it is a finite real number (numpy's too; not a bool, ``None`` or a
    string) in ``[low, high]``, else ``ValueError`` naming ``name`` and the range."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not (math.isfinite(value) and low <= value <= high):
        span = f"between {low:g} and {high:g}" if math.isfinite(high) else f"a finite number >= {low:g}"
        raise ValueError(f"{name} must be {span}{unit}, got {value!r}")
    return float(value)


MAX_POSITION = math.isqrt(2**63 - 1)
"""The largest token position (document length) whose pair counts ``t (t + 1)`` fit in int64
(3,037,000,499): ``DocumentPieces`` refuses documents longer than this rather than overflow silently."""


def batch_tokens_problem(ranks: int, tokens_per_rank: int, names=("ranks", "tokens_per_rank")) -> str | None:
    """What is wrong with a batch of ``ranks x tokens_per_rank`` tokens (a document may span all of
    them: positions past ``MAX_POSITION`` overflow the pair counts), naming ``names`` (argument or flag
    names), or ``None``; the one home of the rule for the simulator and the benchmarks."""
    total = ranks * tokens_per_rank
    if total > MAX_POSITION:
        return (f"{names[0]} x {names[1]} = {total} tokens per batch; at most {MAX_POSITION} (positions past it "
                "overflow the pair counts)")
    return None


def check_document_lengths(lengths, where: str = "lengths", *, minimum: int = 0) -> np.ndarray:
    """``lengths`` (a list, tuple or 1-D array of document lengths, tokens) as ``[documents]`` int64;
    else ``ValueError`` starting with ``where`` and naming the first bad entry: each must be an
    integer (numpy's too; not a float, a string or a bool) from ``minimum`` to ``MAX_POSITION``."""
    data = lengths.tolist() if isinstance(lengths, np.ndarray) and lengths.ndim == 1 else lengths
    if not isinstance(data, (list, tuple)):
        raise ValueError(f"{where} must be a list of document lengths (integer tokens), got {lengths!r}")
    for index, length in enumerate(data):
        if not (is_integer(length) and minimum <= length <= MAX_POSITION):
            raise ValueError(f"{where}[{index}] is {length!r}; every document length must be an integer >= "
                             f"{minimum} token{'' if minimum == 1 else 's'}, at most {MAX_POSITION}")
    return np.asarray(data, dtype=np.int64).reshape(-1)


def causal_pairs(q_start, q_end, window=None):
    """Pairs of the queries ``[q_start, q_end)`` of a document, bottom-right causal: query ``t`` sees
    ``t + 1`` keys, or ``min(t + 1, window)`` under a sliding window (HF's ``sliding_window``: the
    keys ``[t - window + 1, t]``). Exact on Python ints; elementwise on int64 numpy arrays (lists are
    converted) and integer tensors."""
    if type(q_start) is not int and isinstance(q_start, (list, tuple)) or (  # ints first: the planner's hot path
            type(q_end) is not int and isinstance(q_end, (list, tuple))):
        q_start, q_end = np.asarray(q_start, dtype=np.int64), np.asarray(q_end, dtype=np.int64)
    if window is None:
        return (q_end * (q_end + 1) - q_start * (q_start + 1)) // 2
    # queries before position `window` see t + 1 keys; from there on, `window` keys each
    if isinstance(q_start, int) and isinstance(q_end, int):
        head_end = min(q_end, window)
        head_start, tail_start = min(q_start, head_end), max(q_start, head_end)
    else:  # numpy arrays or tensors, alone or beside an int (np.minimum / np.maximum broadcast)
        head_end = np.minimum(q_end, window)
        head_start, tail_start = np.minimum(q_start, head_end), np.maximum(q_start, head_end)
    return causal_pairs(head_start, head_end) + window * (q_end - tail_start)


def document_pairs(length, window=None):
    """Pairs of a whole causal document of ``length`` tokens (ints or arrays)."""
    return causal_pairs(0, length, window)


def key_start(q_start, window=None):
    """First key position the queries ``[q_start, ..)`` of a document see: 0, or
    ``q_start - window + 1`` under a sliding window (ints or arrays)."""
    if window is None:
        return q_start * 0
    return np.maximum(q_start - window + 1, 0) if not isinstance(q_start, int) else max(q_start - window + 1, 0)


def _pairs_below(q_start, q_end, x, window):
    """Pairs of the queries ``[q_start, q_end)`` with keys before position ``x`` (numpy int64 arrays):
    query ``t`` sees ``max(0, min(t + 1, x) - key_start(t, window))`` of them."""
    seen_all = np.clip(x, q_start, q_end)  # queries t < x see all their keys below x
    head = causal_pairs(q_start, seen_all, window)
    lo = np.maximum(q_start, x)  # queries t >= x see the keys [key_start(t), x)
    if window is None:
        return head + x * np.maximum(q_end - lo, 0)
    hi = np.minimum(q_end, x + window - 1)  # from t = x + window - 1 on, the window starts at x or later
    before = lambda n: (lambda m: m * (m + 1) // 2)(np.maximum(n - window, 0))  # sum of key_start(t), t < n
    return head + np.where(hi > lo, x * (hi - lo) - (before(hi) - before(lo)), 0)


def tile_pairs(q_start, q_end, k_start, k_end, window=None):
    """Pairs of a tile: the queries ``[q_start, q_end)`` of a document against its keys ``[k_start,
    k_end)`` (a key-split CA-task), bottom-right causal and under a sliding ``window`` as
    ``causal_pairs``: query ``t`` sees the keys of ``[k_start, k_end)`` in ``[key_start(t, window),
    t]``. ``tile_pairs(a, b, key_start(a, window), b, window) == causal_pairs(a, b, window)``.
    Elementwise on int64 arrays (ints are welcome)."""
    q_start, q_end, k_start, k_end = (np.asarray(x, dtype=np.int64) for x in (q_start, q_end, k_start, k_end))
    return _pairs_below(q_start, q_end, k_end, window) - _pairs_below(q_start, q_end, k_start, window)


def start_with_pairs(q_end: int, pairs: float, window=None) -> float:
    """The real ``q_start`` whose queries ``[q_start, q_end)`` hold ``pairs`` pairs (the inverse of
    ``causal_pairs``): ``q_start (q_start + 1) = q_end (q_end + 1) - 2 pairs`` without a window."""
    if window is not None and q_end > window:
        flat = window * (q_end - window)  # queries at positions >= window hold `window` pairs each
        if pairs <= flat:
            return q_end - pairs / window
        return start_with_pairs(window, pairs - flat)
    return (-1.0 + math.sqrt(max(1.0 + 4.0 * (q_end * (q_end + 1) - 2.0 * pairs), 0.0))) / 2.0


def end_with_pairs(q_start: int, pairs: float, window=None) -> float:
    """The real ``q_end`` whose queries ``[q_start, q_end)`` hold ``pairs`` pairs (the inverse of
    ``causal_pairs`` in its end): the document's pairs up to ``q_end`` are those up to ``q_start``
    plus ``pairs``; without a window ``q_end (q_end + 1) = q_start (q_start + 1) + 2 pairs``."""
    total = float(document_pairs(q_start, window)) + pairs
    if window is not None and total > window * (window + 1) / 2:
        return window + (total - window * (window + 1) / 2) / window  # `window` pairs per query from there on
    return (-1.0 + math.sqrt(1.0 + 8.0 * total)) / 2.0


def imbalance(loads, ranks=None) -> float:
    """max / mean of per-rank ``loads`` (pairs, seconds, ...) over ``ranks`` (all by default); 1.0
    when there is no load."""
    loads = np.asarray(loads, dtype=np.float64)
    if ranks is not None:
        loads = loads[list(ranks)]
    mean = loads.mean() if loads.size else 0.0
    return float(loads.max() / mean) if mean > 0 else 1.0


def attention_flops(pairs: int, num_heads: int, head_dim: int, backward: bool = False) -> int:
    """FLOPs of core attention over ``pairs`` query-key pairs.

    Forward is two matmuls (QK^T and PV): ``4 * pairs * heads * head_dim``. Backward recomputes QK^T
    and runs four more matmuls (dV, dP, dQ, dK), 2.5x the forward; ``backward=True`` returns
    forward + backward.
    """
    forward = 4 * pairs * num_heads * head_dim
    return forward * 7 // 2 if backward else forward


MAX_MODEL_WIDTH = 2**20
"""The largest hidden size, head count or head dimension ``TokenBytes.for_model`` takes (elements):
64x today's widest models, small enough that bytes, pair counts and seconds stay finite."""

MAX_TOKEN_BYTES = 2**24
"""The most bytes one token's q, k/v, out or log-sum-exp may take in ``TokenBytes`` (16 MiB, 300x a
bf16 query of today's widest models): times any token count up to ``MAX_POSITION`` it fits in int64."""


@dataclass(frozen=True)
class TokenBytes:
    """Bytes one token costs on the wire in one layer's forward, and what attention's backward keeps
    of it.

    Attributes:
        q: query, ``num_heads * head_dim * dtype_bytes``.
        kv: key + value, ``2 * num_kv_heads * head_dim * dtype_bytes``.
        o: attention output returned, same size as the query.
        lse: the query's log-sum-exp, fp32, one per head (``4 * num_heads``): returned with the
            output in ``resend`` mode and kept for the backward (0 when unknown).
    """

    q: int
    kv: int
    o: int
    lse: int = 0

    def __post_init__(self):
        for name in ("q", "kv", "o", "lse"):
            value = getattr(self, name)
            if not (is_integer(value) and 0 <= value <= MAX_TOKEN_BYTES):
                raise ValueError(f"TokenBytes.{name} must be an integer from 0 to {MAX_TOKEN_BYTES} (bytes per token), "
                                 f"got {value!r}")

    @property
    def held(self) -> int:
        """Bytes attention's backward keeps per token of a rank's own in one layer, colocated (HF's
        flash paths, and distca in ``resend`` mode): its q, k, v, out and log-sum-exp. The memory
        formula's unit of "own activations" (``transfers.backward_memory``)."""
        return self.q + self.kv + self.o + self.lse

    @classmethod
    def for_model(cls, hidden: int, heads: int, kv_heads: int, dtype_bytes: int = 2, head_dim: int | None = None):
        """The bytes of a model of ``hidden`` elements per token, ``heads`` query and ``kv_heads`` key/value
        heads of ``head_dim`` elements (default ``hidden // heads``), ``dtype_bytes`` each; each of them
        an integer from 1 to ``MAX_MODEL_WIDTH``."""
        problem = head_split_problem(heads, kv_heads)
        if problem:
            raise ValueError(problem)
        for name, value in (("hidden", hidden), ("dtype_bytes", dtype_bytes),
                            ("head_dim", 1 if head_dim is None else head_dim)):
            if not (is_integer(value) and 1 <= value <= MAX_MODEL_WIDTH):
                raise ValueError(f"{name} must be an integer from 1 to {MAX_MODEL_WIDTH}, got {value!r}")
        head_dim = head_dim or hidden // heads
        if head_dim <= 0:
            raise ValueError(f"head_dim must be positive (hidden={hidden}, heads={heads})")
        q = heads * head_dim * dtype_bytes
        return cls(q=q, kv=2 * kv_heads * head_dim * dtype_bytes, o=q, lse=4 * heads)


def head_split_problem(heads, kv_heads) -> str | None:
    """Why ``heads`` query and ``kv_heads`` key/value heads are not a model's head split (each an integer
    from 1 to ``MAX_MODEL_WIDTH``, ``heads`` a multiple of ``kv_heads``), or ``None``."""
    for name, value in (("heads", heads), ("kv_heads", kv_heads)):
        if not (is_integer(value) and 1 <= value <= MAX_MODEL_WIDTH):
            return f"{name} must be an integer from 1 to {MAX_MODEL_WIDTH}, got {value!r}"
    if heads % kv_heads:
        return f"heads ({heads}) must be a positive multiple of kv_heads ({kv_heads})"
    return None


LLAMA3_8B_BYTES = TokenBytes.for_model(hidden=4096, heads=32, kv_heads=8)

COMM_PASSES = {"saved": 2.0, "resend": 3.0}
"""A layer's bytes (forward + backward) in units of its forward's, per backward mode. ``saved``:
the forward sends Q and K/V out and O back; the backward sends dO out and dQ, dK/dV back, as many
again. ``resend``: the backward also sends q, k/v and out again with dO, twice the forward's (the
log-sum-exp, 4 bytes per head and query, not counted)."""


MAX_MODEL_SECONDS = 1e6
"""The most seconds a ``TimeModel`` constant may take (per token, pair, task, key or collective): times
any pair count up to ``MAX_POSITION``'s a layer's seconds stay finite."""


@dataclass(frozen=True)
class TimeModel:
    """Seconds of one transformer layer, forward + backward, on one device.

    ``rank_time = linear_s_per_token * tokens + sum over its CA-tasks of task_seconds(pairs, keys)
    + exposed communication``, with ``task_seconds = attn_s_per_pair * pairs + task_key_s * keys +
    task_s`` (``keys``: the task's K/V tokens) and communication ``bytes / bytes_per_s`` plus
    ``collective_s`` for a layer whose dispatch moves anything.

    Attributes:
        linear_s_per_token: projections, MLP, norms: everything but core attention, per token.
        attn_s_per_pair: core attention per query-key pair.
        task_s: fixed cost of one CA-task (one varlen sequence) in the kernel.
        bytes_per_s: bytes a rank sends plus receives per second in the dispatch's all-to-alls.
        source: where the constants come from (``distca-hf profile`` writes the device here).
        task_key_s: seconds per K/V token of each task beyond its pairs: the kernel's pass over a
            task's keys costs this whatever its queries (flash kernels run a 128-query tile row per
            key tile and the backward's key-tile loop per task), so a thin shard against a long prefix
            is worth less than its pair count says (issue 12: 16 shards of 128 queries against 64k
            keys ran at 53% of whole documents' TFLOP/s on an H100).
        collective_s: fixed seconds of a layer (forward + backward) whose dispatch moves anything:
            the latency of its all-to-alls and the dispatch's own work, whatever the bytes.
    """

    linear_s_per_token: float
    attn_s_per_pair: float
    task_s: float = 0.0
    bytes_per_s: float = 50e9
    source: str = "model"
    task_key_s: float = 0.0
    collective_s: float = 0.0

    def __post_init__(self):
        # bounded so that a layer's seconds stay finite whatever its pair counts (a byte a second is
        # slower than any link; tests use unit-free models of a few seconds per pair)
        for name in ("linear_s_per_token", "attn_s_per_pair", "task_s", "task_key_s", "collective_s"):
            check_number(getattr(self, name), f"TimeModel.{name}", high=MAX_MODEL_SECONDS, unit=" seconds")
        check_number(self.bytes_per_s, "TimeModel.bytes_per_s", low=1.0, unit=" bytes per second")
        if self.linear_s_per_token == 0 and self.attn_s_per_pair == 0:  # (speedups divided by zero, NaN in JSON)
            raise ValueError("TimeModel.linear_s_per_token and attn_s_per_pair are both 0: a step would take no "
                             "time, and no plan or method could be timed against another; give either a cost")

    def rank_seconds(self, tokens, pairs, tasks=0, keys=0, *, other_s=None):
        """Per-rank compute time of a layer: ``tokens`` through the linear layers and kernel tasks
        totalling ``pairs`` pairs, ``keys`` K/V tokens and ``tasks`` tasks (the sum of their
        ``task_seconds``); works on scalars and numpy arrays alike. ``other_s``: seconds of the work
        besides attention that replace the tokens' linear layers (``rank_time.other_seconds``)."""
        other = self.linear_s_per_token * tokens if other_s is None else other_s
        return other + self.attn_s_per_pair * pairs + self.task_key_s * keys + self.task_s * tasks

    def comm_seconds(self, sent, received, exposed_comm: float = 1.0, moves: bool = True, backward: str = "saved"):
        """Exposed communication time of a layer, forward + backward, for a rank that sends ``sent``
        and receives ``received`` bytes in its forward: the fraction ``exposed_comm`` the overlap
        does not hide of ``COMM_PASSES[backward] (sent + received) / bytes_per_s``, plus
        ``collective_s`` when anything crosses ranks (``moves``)."""
        return (exposed_comm * COMM_PASSES[backward] * (sent + received) / self.bytes_per_s
                + (self.collective_s if moves else 0.0))

    def byte_seconds(self, exposed_comm: float = 1.0, backward: str = "saved") -> float:
        """``comm_seconds``' exposed seconds per byte a rank sends or receives in its forward (what the
        greedy planners add move by move; ``collective_s`` is counted apart)."""
        return exposed_comm * COMM_PASSES[backward] / self.bytes_per_s

    def task_seconds(self, pairs, keys):
        """Kernel seconds of CA-tasks of ``pairs`` pairs over ``keys`` K/V tokens (scalars or arrays,
        one entry per task), forward + backward."""
        return self.attn_s_per_pair * pairs + self.task_key_s * keys + self.task_s

    def scaled(self, shape: dict, reference: dict, source: str | None = None) -> "TimeModel":
        """These constants, measured on a model of shape ``reference``, carried to ``shape`` by the
        FLOP model (``from_flops``): ``linear_s_per_token`` by the ratio of the linear FLOPs per
        token, ``attn_s_per_pair`` and ``task_key_s`` by the ratio of attention FLOPs per pair
        (``heads * head_dim``). ``task_s``, ``bytes_per_s`` and ``collective_s`` do not depend on the
        shape. Shapes: dicts of ``hidden``, ``intermediate``, ``heads``, ``kv_heads`` (and optionally
        ``head_dim``)."""
        new, old = TimeModel.from_flops(**shape), TimeModel.from_flops(**reference)
        attn = new.attn_s_per_pair / old.attn_s_per_pair
        return TimeModel(self.linear_s_per_token * new.linear_s_per_token / old.linear_s_per_token,
                         self.attn_s_per_pair * attn, self.task_s, self.bytes_per_s, source or self.source,
                         self.task_key_s * attn, self.collective_s)

    @classmethod
    def from_flops(cls, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int | None = None,
                   linear_flops_per_s: float = 600e12, attn_flops_per_s: float = 400e12, task_s: float = 2e-6,
                   bytes_per_s: float = 50e9) -> "TimeModel":
        """Constants from FLOP counts at assumed sustained rates (defaults: an H100 in bf16)."""
        for name, value in (("hidden", hidden), ("intermediate", intermediate), ("heads", heads),
                            ("kv_heads", kv_heads), ("head_dim", 1 if head_dim is None else head_dim)):
            if not (is_integer(value) and value >= 1):  # (0 heads divided by zero, "64" failed in an operator)
                raise ValueError(f"TimeModel.from_flops: {name} must be an integer >= 1, got {value!r}")
        for name, value in (("linear_flops_per_s", linear_flops_per_s), ("attn_flops_per_s", attn_flops_per_s)):
            if not (is_number(value) and 0 < value < math.inf):
                raise ValueError(f"TimeModel.from_flops: {name} must be a positive number (FLOP/s), got {value!r}")
        head_dim = head_dim or hidden // heads
        params = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * intermediate
        linear = 6 * params / linear_flops_per_s  # forward 2 FLOPs per weight, backward 4
        attn = attention_flops(1, heads, head_dim, backward=True) / attn_flops_per_s
        return cls(linear, attn, task_s, bytes_per_s, source=f"FLOP model ({linear_flops_per_s / 1e12:.0f}/"
                   f"{attn_flops_per_s / 1e12:.0f} TFLOP/s linear/attention)")

    @classmethod
    def load(cls, path) -> "TimeModel":
        """The model a JSON object in ``path`` holds (``save``'s); a missing or unreadable file, other
        JSON or a bad value is a ``ValueError`` naming the file."""
        return cls.load_profile(path)[0]

    @classmethod
    def load_profile(cls, path) -> "tuple[TimeModel, dict | None]":
        """``(load(path), shape)``: ``shape`` is the model shape ``distca-hf profile`` measured on
        (``{"hidden", "intermediate", "heads", "kv_heads"}``, integers >= 1), None when the file does
        not say. The constants hold for that shape: a caller planning another one says so."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: cannot read a time model ({getattr(e, 'strerror', None) or e})") from None
        except RecursionError:
            raise ValueError(f"{path}: cannot read a time model (JSON nested too deeply)") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a time model is a JSON object of its fields, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known - {"shape"}
        if unknown:
            raise ValueError(f"{path}: unknown time-model keys {sorted(unknown)}; expected {sorted(known)}")
        required = sorted(f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING)
        missing = [k for k in required if k not in data]
        if missing:
            raise ValueError(f"{path}: the time model lacks the keys {missing} (`distca-hf profile` writes them all)")
        shape = data.get("shape")
        if shape is not None and not (isinstance(shape, dict) and set(shape) <= set(PROFILE_SHAPE_KEYS) and all(
                type(v) is int and v >= 1 for v in shape.values())):
            raise ValueError(f"{path}: 'shape' must map {list(PROFILE_SHAPE_KEYS)} to integers >= 1 (the model "
                             f"`distca-hf profile` measured), got {shape!r}")
        try:
            return cls(**{k: v for k, v in data.items() if k in known}), shape
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def save(self, path, **extra) -> None:
        Path(path).write_text(json.dumps({**asdict(self), **extra}, indent=2) + "\n")


PROFILE_SHAPE_KEYS = ("hidden", "intermediate", "heads", "kv_heads")
"""The model shape a ``distca-hf profile`` file records (``TimeModel.load_profile``)."""

LLAMA3_8B_H100 = TimeModel.from_flops(hidden=4096, intermediate=14336, heads=32, kv_heads=8)

LLAMA3_8B_SHAPE = {"hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8, "head_dim": 128}

H100_MEASURED = TimeModel(
    linear_s_per_token=2.15e-6, attn_s_per_pair=0.170e-9, task_s=2e-6, bytes_per_s=50e9,
    source="built-in CUDA default: H100 measured (bf16, Llama-3-8B layer, PyTorch's flash kernel; issue 13)",
    task_key_s=0.89 * 128 * 0.170e-9, collective_s=100e-6)
"""The built-in CUDA model, at ``LLAMA3_8B_SHAPE``. Linear 2.15 us per token and attention 0.170 ns
per pair (forward + backward, bf16) were measured on one H100. ``task_key_s`` makes a task of 128
queries against 64k keys run at 53% of the pair rate, as measured (issue 12): its pairs take
``128 * 65536 * attn_s_per_pair`` and its keys ``0.89`` times that, i.e. the cost of ``0.89 * 128``
more queries per key. ``task_s`` (2 us per varlen sequence) and ``collective_s`` (100 us: four
NCCL all-to-alls of a layer at about 25 us each) are estimates; ``bytes_per_s`` assumes 50 GB/s
per rank (400 Gb/s InfiniBand). Measure your own with ``distca-hf profile`` (``DISTCA_TIME_MODEL``)."""

CPU_GLOO_SHAPE = {"hidden": 256, "intermediate": 688, "heads": 8, "kv_heads": 2, "head_dim": 32}

CPU_GLOO_MEASURED = TimeModel(
    linear_s_per_token=115e-6, attn_s_per_pair=78e-9, task_s=0.36e-3, bytes_per_s=100e6,
    source="built-in CPU default: measured on 2 CPU processes over gloo (fp32, one thread each, torch_cpu kernel)",
    task_key_s=1.5e-6, collective_s=25e-3)
"""The built-in CPU model, at ``CPU_GLOO_SHAPE`` (``distca-hf bench``'s model), measured on the
2-core machine this package is developed on: two processes, one torch thread each, fp32.

- ``linear_s_per_token`` (115 us) and ``attn_s_per_pair`` (78 ns): from ``distca-hf bench``'s
  colocated step and its ideal on a quiet machine (README: 13.82 s and 8.95 s for 4 layers; the
  skewed batch's ranks hold 33.6M and 1.05M pairs of 8192 tokens): ``L + 33.6M a = 3.46 s`` and
  ``L + 17.3M a = 2.24 s`` per layer. ``distca-hf profile`` measures the same terms on one process.
- ``task_s`` (0.36 ms) and ``task_key_s`` (1.5 us per key): a least-squares fit of the
  ``torch_cpu`` kernel (forward + backward) over fused batches of 1 to 64 tasks, 64 to 4096 queries
  against 64 to 4096 keys each, scaled to the quiet machine's pair rate.
- ``collective_s`` (25 ms) and ``bytes_per_s`` (100 MB/s, bytes a rank sends plus receives): what a
  dispatched layer costs beyond its balanced kernels, fitted to two measurements: the bench model's
  skewed step (distca 9.72 s against its ideal 8.95 s for 4 layers: 0.19 s per layer moving 8.8 MB
  forward and as many back) and the demo's model (hidden 64, 2 heads, 1 K/V head) on the bench's
  ``mixed`` rounds (about 50 ms per layer above colocated moving 1.3 MB). A gloo
  ``all_to_all_single`` alone takes about 0.3 ms and moves about 1 GB/s on loopback; the rest is the
  dispatch's own work (packing, scattering, Python) and the two processes meeting at each of a
  layer's four all-to-alls on a 2-core machine.

Other 2-core machines, or these processes beside other jobs, differ: measure with ``distca-hf
profile`` and set ``DISTCA_TIME_MODEL``."""


def check_time_model(time_model) -> TimeModel:
    """``time_model`` when it is a ``TimeModel``, else ``TypeError`` naming the argument."""
    if not isinstance(time_model, TimeModel):
        raise TypeError(f"time_model must be a TimeModel, got {type(time_model).__name__}")
    return time_model


def default_time_model(device_type: str, token_bytes: TokenBytes, dtype_bytes: int) -> TimeModel:
    """The built-in time model of a device kind (``"cuda"``: ``H100_MEASURED``, anything else:
    ``CPU_GLOO_MEASURED``) carried by ``TimeModel.scaled`` to the model whose tokens are
    ``token_bytes`` in ``dtype_bytes``-byte elements. Attention FLOPs per pair and the projections
    depend on the heads only through the widths ``heads * head_dim`` (``token_bytes.q``) and
    ``kv_heads * head_dim`` (``token_bytes.kv / 2``), so the shape is written with head_dim 1. The
    attention call does not see the hidden and MLP sizes: the shape assumes ``hidden = heads *
    head_dim`` and Llama-3's MLP ratio ``intermediate = 3.5 * hidden``; only the linear part depends
    on them, and it matters to a plan only when ranks hold different token counts."""
    q_width, kv_width = token_bytes.q // dtype_bytes, token_bytes.kv // (2 * dtype_bytes)
    shape = {"hidden": q_width, "intermediate": int(3.5 * q_width), "heads": q_width, "kv_heads": kv_width,
             "head_dim": 1}
    if device_type == "cuda":
        return H100_MEASURED.scaled(shape, LLAMA3_8B_SHAPE)
    return CPU_GLOO_MEASURED.scaled(shape, CPU_GLOO_SHAPE)


def resolve_time_model(setting, device_type: str, token_bytes: TokenBytes, dtype_bytes: int) -> TimeModel:
    """The ``time_model`` setting as a ``TimeModel``: ``None`` -> ``default_time_model``; a path ->
    ``TimeModel.load`` (used as measured: profile the model you train); a ``TimeModel`` as given."""
    if setting is None:
        return default_time_model(device_type, token_bytes, dtype_bytes)
    if isinstance(setting, TimeModel):
        return setting
    try:  # a training run resolves the setting at every planned forward: the file is read once per version
        version = file_version(setting)
    except (OSError, TypeError, ValueError):
        return TimeModel.load(setting)  # (its ValueError names the file)
    return _load_time_model_file(os.fspath(setting), version)


@functools.lru_cache(maxsize=8)
def _load_time_model_file(path: str, version: tuple) -> TimeModel:
    """``TimeModel.load(path)`` cached by the file's ``config.file_version`` (a file rewritten or
    replaced is read again); ``TimeModel`` is frozen, so sharing one is safe."""
    return TimeModel.load(path)
