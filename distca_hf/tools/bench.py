"""``distca-hf bench``: a real multi-process step-time comparison, colocated against distca.

Every rank builds the same small Llama-like model and its own packed batch of ``--workload``:

- ``skewed`` (default): even ranks hold one long document, odd ranks many short ones (the straggler
  pattern CAD removes);
- ``balanced``: two documents per rank whose split differs between even and odd ranks, so every
  rank's attention is within a few percent of the mean (about 1.03 max/mean): a step distca cannot
  speed up, where it must not be slower;
- ``mixed``: every round a new batch drawn from a length sample (the demo's documents: the Python
  help topics at about 3 characters a token, 67 to 20k tokens) packed rank after rank;
- ``sample:FILE.json``: the same with the lengths (a JSON list of token counts) in FILE;
- ``demo``: below;
- ``long``: below.

A comma list (``--workload skewed,balanced,mixed``) runs several, one after the other in the same
processes, each measured side by side. Both methods run the same data with the same exact
per-document kernel; *colocated* computes each rank's documents where they are, *distca* plans
(``--tolerance``, default ``auto``: by time) and dispatches. Step time is forward + backward, timed
between barriers (so it is the slowest rank's), median over ``--steps`` after ``--warmup``. The
methods take turns step by step (colocated, then each distca setting, then again, each round on its
own batch), so the ratios are measured side by side even on a machine whose speed drifts; the JSON
and the table give the per-step speedup of each distca setting over colocated (min / median / max
over rounds). ``--quick``: small sizes for a check in about a minute (``--tokens 2048 --steps 3
--warmup 1 --layers 2`` unless given).

``--overlap none,wave,pingpong`` also runs the overlap modes; for each it reports the step time and
``overlap_fraction``: communication time hidden under compute / total communication time, from the
timeline (``distca_hf.runtime.timeline``: an all-to-all lasts from launch to completion, and the time a rank
blocks waiting for it is the part not hidden), over all ranks, forward and backward apart.
``--trace OUT.json`` writes the last step of each mode as a Chrome trace.

The *ideal* is measured from the colocated run: each rank's time outside the attention kernel plus
the mean over ranks of the kernel time, i.e. the step if attention were perfectly balanced and
communication were free.

``--workload long`` (``long_documents``): one document spans every rank beside short ones: short
documents, then the long one starting in rank 0's row and ending in the last rank's, then short ones
(the ranks hold consecutive slices of that stream). It compares distca (``span_ranks=True``) with
per-document context parallelism (``context_parallel``: the spanning document head-tail balanced
over its holders, its K/V all-gathered in every layer, whole documents where they are), DeepSpeed
Ulysses (``ulysses``: ALST's ``UlyssesSPAttentionHF`` with the same kernel as its core) and
*colocated-where-possible*: each rank computes its own pieces with no communication, which for the
spanning document is **not** its attention (a piece sees only itself): the no-communication lower
bound, not a method. Every method runs the same tokens with the same kernel; all but colocated are
exact. Per method: the median step time (methods taking turns), the bytes sent in one layer's
forward (all ranks, counted at the ``torch.distributed`` calls), and memory: the peak of tensor
bytes allocated during one forward + backward and alive at once, and those still alive when the
forward ends (kept for backward), from ``TensorMemory``, max over ranks; also the per-step speedup
of distca over each baseline (min / median / max over steps).

``--workload demo`` (``demo_document_lengths``, ``demo_dataset``): the global batches ``make demo``
trains, exactly: its documents (the pydoc topics tokenized by its offline byte-level BPE, the first
8 held out for evaluation, ``training.offline_corpus``) packed as ``DistCATrainer`` packs them
(``PackedDataset(..., span_ranks=True)``, ``PackingConfig(tokens_per_rank=--tokens, seed=0)``: global
batches of ``world x --tokens`` tokens whose documents span ranks; a rank's row that continues a
document starts at its ``position_ids`` p > 0) and collated by ``PackedCollator``; random token ids
stand in for the text (the step time does not depend on them). The loss is the demo's: transformers'
causal-LM loss over ``labels`` / ``shift_labels``, normalised by the global batch's label tokens.
Every method runs with ``span_ranks=True`` (colocated too: its continuing pieces still receive their
document's K/V prefix). The model is the demo's (hidden 64, intermediate 128, 2 layers, 2 heads, 1
K/V head) unless those flags are given. A *round* runs every global batch once, in packing order,
every method in turns on each batch; ``--warmup`` rounds (default 1) come first, then ``--steps``
measured rounds (default 3; ``--global-batches N`` keeps the first N batches). Each batch (one
step of the demo) is timed per method by its fastest measured round (a shared machine's noise only
ever adds time); the table and the JSON give per batch the colocated and distca times and their
ratio, the per-step ratios (min / median / max over batches), the batches more than 3% slower than
colocated, and the whole-run speedup (sum of colocated times / sum of distca times) against the
demo's targets (whole run >= 1.25x, no batch below 0.97x; reported for the demo's own sizes only).
No measured ideal here: colocated itself sends the prefix K/V of the documents that span ranks.

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

__all__ = ["build_parser", "main"]


WORKLOADS = ("skewed", "balanced", "mixed", "long", "demo")
"""``--workload`` names (besides ``sample:FILE.json``)."""

ALONE = {"long": "its methods differ", "demo": "its model and settings differ"}
"""Workloads that run alone, and why."""

BALANCED_SHIFT = 0.12
"""``balanced``: odd ranks hold documents of ``(1/2 + 0.12)`` and ``(1/2 - 0.12)`` of their tokens,
even ranks two halves: ``1 + 4 * 0.12**2`` = 1.058 times the pairs, 1.028 max/mean on two ranks."""


def skewed_batch(rank: int, tokens: int, short_docs: int):
    """Document lengths of ``rank``'s micro-batch: one long document on even ranks, ``short_docs``
    equal ones (the remainder spread over the first) on odd ranks."""
    if rank % 2 == 0:
        return [tokens]
    base = tokens // short_docs
    return [base + (1 if i < tokens % short_docs else 0) for i in range(short_docs)]


def balanced_batch(rank: int, tokens: int) -> list[int]:
    """``balanced``: two halves on even ranks, halves shifted by ``BALANCED_SHIFT`` on odd ones."""
    shift = round(BALANCED_SHIFT * tokens) if rank % 2 else 0
    half = tokens // 2
    return [n for n in (half + shift, tokens - half - shift) if n > 0]


def demo_lengths() -> list[int]:
    """The demo's documents as token counts: the Python help topics (``pydoc_data.topics``) at 3
    characters a token, about what the demo's byte-level BPE gives."""
    from ..training.offline_corpus import pydoc_topics

    return [max(1, len(text) // 3) for text in pydoc_topics()]


def sample_lengths(workload: str) -> list[int]:
    """The length sample of ``mixed`` or ``sample:FILE.json`` (a JSON list of positive ints)."""
    if workload == "mixed":
        return demo_lengths()
    path = workload.removeprefix("sample:")
    try:
        with open(path) as f:
            lengths = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--workload sample:FILE.json: cannot read {path!r} ({e})") from None
    if not (isinstance(lengths, list) and lengths and all(isinstance(n, int) and n > 0 for n in lengths)):
        raise ValueError(f"--workload sample:FILE.json: {path!r} must hold a non-empty JSON list of positive "
                         "document lengths (tokens)")
    return lengths


def drawn_batches(lengths: list[int], world: int, tokens: int, seed: int) -> list[list[int]]:
    """One batch of ``mixed`` / ``sample:``: documents drawn (with replacement, ``seed``) from
    ``lengths`` and packed rank after rank, ``tokens`` each; a document that does not fit is cut
    at the end of the rank (its rest is dropped: each rank packs alone)."""
    import random

    rng = random.Random(seed)
    batches = []
    for _ in range(world):
        batch, room = [], tokens
        while room:
            n = min(rng.choice(lengths), room)
            batch.append(n)
            room -= n
        batches.append(batch)
    return batches


def workload_batches(workload: str, world: int, tokens: int, short_docs: int, rounds: int) -> list[list[list[int]]]:
    """``[round][rank]`` document lengths of every round (warm-up rounds first) of a workload."""
    if workload == "skewed":
        return [[skewed_batch(r, tokens, short_docs) for r in range(world)]] * rounds
    if workload == "balanced":
        return [[balanced_batch(r, tokens) for r in range(world)]] * rounds
    lengths = sample_lengths(workload)
    return [drawn_batches(lengths, world, tokens, seed) for seed in range(rounds)]


# --- --workload demo: make demo's own global batches ---


DEMO_EVAL_DOCUMENTS = 8
"""Documents the demo holds out for evaluation (its ``--eval_documents`` default): the first ones."""

DEMO_MODEL = {"hidden": 64, "intermediate": 128, "layers": 2, "heads": 2, "kv_heads": 1}
"""The demo's tiny Llama (``examples/finetune_long_context.py``, ``tiny_llama``): ``--workload demo``'s
model unless these flags are given."""

DEMO_ROUNDS = 3
"""``--workload demo``: measured rounds unless ``--steps`` is given (each runs every global batch)."""

DEMO_TARGET = {"whole_run_speedup_at_least": 1.25, "per_step_speedup_at_least": 0.97}
"""The demo's targets: the whole run >= 1.25x colocated and no step (global batch) more than 3%
slower than its colocated twin."""

DEMO_TOKENS_PER_RANK = 8192
"""The demo's ``--tokens_per_rank`` (and this command's default ``--tokens``)."""


def demo_document_lengths(*, eval_documents: int = DEMO_EVAL_DOCUMENTS) -> tuple[list[int], int]:
    """``(token counts of the documents the demo trains on, its padding token id)``: the pydoc topics
    tokenized by the demo's offline BPE with an end-of-sequence token each (``load_documents``),
    without the first ``min(eval_documents, documents // 4)`` (held out for evaluation, as the demo's
    ``load_data`` does). Trains the tokenizer: a few seconds.

    Raises:
        ImportError: ``tokenizers`` (or ``datasets``) is missing, named in the message.
    """
    try:
        import datasets
    except ImportError:
        raise ImportError("the demo's documents need the 'datasets' package: pip install datasets") from None

    from ..training.loading import load_documents
    from ..training.offline_corpus import offline_tokenizer, pydoc_topics

    texts = pydoc_topics()
    tokenizer = offline_tokenizer(texts)
    datasets.disable_progress_bars()
    documents = load_documents(datasets.Dataset.from_dict({"text": texts}), tokenizer)
    held_out = min(eval_documents, len(documents) // 4)
    lengths = [len(ids) for ids in documents["input_ids"][held_out:]]
    return lengths, tokenizer.pad_token_id or 0


def demo_packing_config(tokens: int, pad_token_id: int):
    """The ``PackingConfig`` the demo's trainer packs with (``--seed 0``: a shuffled document order)."""
    from ..training.packing import PackingConfig

    return PackingConfig(tokens_per_rank=tokens, seed=0, pad_token_id=pad_token_id)


def demo_dataset(lengths: list[int], *, world: int, tokens: int, pad_token_id: int, vocab: int):
    """The demo's packed rows of documents of ``lengths`` tokens for ``world`` ranks of ``tokens``
    each, as its trainer builds them: a ``PackedDataset`` with ``span_ranks=True``, item
    ``g * world + r`` rank ``r``'s row of global batch ``g``. Random token ids below ``vocab``
    (seeded, the same on every rank) stand in for the text."""
    import torch

    from ..training.packing import PackedDataset

    g = torch.Generator().manual_seed(0)
    documents = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    return PackedDataset(documents, demo_packing_config(tokens, pad_token_id), world_size=world, span_ranks=True)


def demo_inputs(dataset, batch: int, rank: int) -> dict:
    """Rank ``rank``'s model inputs for global batch ``batch`` of ``demo_dataset`` (``[1, N]``
    tensors from ``PackedCollator``: ``input_ids``, ``position_ids``, ``labels``, ``shift_labels``,
    ``cu_seq_lens_q/k``, ``max_length_q/k``) and ``num_items_in_batch``: the label tokens of the
    whole global batch, as the trainer normalises the loss."""
    from ..training.packing import PackedCollator

    world = dataset.world_size
    inputs = PackedCollator()([dataset[batch * world + rank]])
    inputs["num_items_in_batch"] = sum(row.label_tokens for row in dataset.rows[batch * world:(batch + 1) * world])
    return inputs


def demo_run_matches(args) -> bool:
    """Whether a ``--workload demo`` run has the demo's sizes (its targets apply only then)."""
    return (not getattr(args, "quick", False) and args.world == 2 and args.tokens == DEMO_TOKENS_PER_RANK
            and args.global_batches is None and all(getattr(args, k) == v for k, v in DEMO_MODEL.items()))


def _demo_step(model, rank: int, world: int, args, device):
    """``(step(i), rounds)``: ``step(i)`` runs global batch ``i % batches`` of the demo (forward +
    backward of the causal-LM loss); ``rounds`` is ``args`` with ``warmup`` and ``steps`` counted
    in batches (``_run_in_turns`` then runs every batch of a round, every method in turns on it)."""
    dataset = demo_dataset(args.demo_lengths, world=world, tokens=args.tokens, pad_token_id=args.demo_pad_token_id,
                           vocab=args.vocab)
    batches = args.demo_global_batches
    inputs = []
    for batch in range(batches):
        one = demo_inputs(dataset, batch, rank)
        inputs.append({k: v.to(device) if hasattr(v, "to") else v for k, v in one.items()})

    def step(i: int):
        model.zero_grad(set_to_none=True)
        model(**inputs[i % batches]).loss.backward()

    rounds = argparse.Namespace(**{**vars(args), "warmup": args.warmup * batches, "steps": args.steps * batches,
                                   "batches_per_round": batches})
    return step, rounds


def _worker(rank: int, world: int, args, port: int, result_path: str | None):
    """One rank of the benchmark: set up, run every method in turns, gather, write (rank 0)."""
    import torch.distributed as dist

    from ..runtime import timeline
    from ..runtime.shutdown import close_process_groups

    device = init_process(rank, world, args, port)
    if args.workload == "long":
        results = _long_worker(rank, world, args, device)
    else:
        # the demo's rows continue documents: positions reach world x tokens
        model = bench_model(args, device, world * args.tokens if args.workload == "demo" else args.tokens)
        kernel_seconds = _time_kernels(device)
        methods = _methods(args)
        timeline.enable()
        results = {}
        for workload in args.workload.split(","):
            if workload == "demo":
                import distca_hf

                distca_hf.configure(span_ranks=True)  # every method, as the demo's trainer does
                step, rounds = _demo_step(model, rank, world, args, device)
            else:
                step, rounds = _training_step(model, rank, world, args, device, workload), args
            runs = _run_in_turns(step, methods, rounds, kernel_seconds, device)
            results[workload] = _gather_results(runs, methods, rank, world, rounds)
    if rank == 0 and result_path:
        with open(result_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    close_process_groups()  # the exit hook's GIL hand-off first: gloo may still be freeing the barrier


def init_process(rank: int, world: int, args, port: int):
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


def bench_model(args, device, max_positions: int):
    """The small Llama-like model, the same weights on every rank."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    import distca_hf  # noqa: F401  (registers "distca")

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=max_positions, use_cache=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="distca").to(device, getattr(torch, args.dtype))


def _training_step(model, rank: int, world: int, args, device, workload: str):
    """``step(round)``: one forward + backward of the model on this rank's batch of ``workload`` in
    that round (rounds ``0 .. warmup - 1`` warm up, then one per measured step)."""
    import torch

    rounds = workload_batches(workload, world, args.tokens, args.short_docs, args.warmup + args.steps)
    g = torch.Generator().manual_seed(rank)
    input_ids = torch.randint(0, args.vocab, (1, args.tokens), generator=g).to(device)
    positions = [torch.cat([torch.arange(n) for n in batch[rank]]).unsqueeze(0).to(device) for batch in rounds]

    def step(i: int):
        model.zero_grad(set_to_none=True)
        out = model(input_ids=input_ids[:, : positions[i].shape[1]], position_ids=positions[i]).logits
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
    """Every method runs once per step, in turns, so a machine whose speed drifts (another job,
    thermal limits) affects all of them alike: the ratios are measured side by side. The turns
    alternate direction (``turn_order``): the method that runs a new batch first pays for growing the
    allocator's buffers and warming the caches, and the next one finds them ready. Returns
    per method a list of ``(step seconds, (this rank's seconds, its kernel seconds), plan_stats,
    timeline events)``."""
    import torch.distributed as dist

    import distca_hf
    from ..runtime import timeline

    def configure(mode, backward_mode, overlap):
        distca_hf.configure(mode=mode, backward=backward_mode, tolerance=args.tolerance, overlap=overlap)

    def timed_step(i, *method):
        configure(*method)
        kernel_seconds[0] = 0.0
        timeline.clear()
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        step(i)
        _sync(device)
        mine = time.perf_counter() - start
        dist.barrier()
        return time.perf_counter() - start, (mine, kernel_seconds[0]), distca_hf.plan_stats(), timeline.events()

    for method in methods:
        configure(*method)
        for i in range(args.warmup):
            step(i)
    runs = {method: [] for method in methods}
    per_round = getattr(args, "batches_per_round", 1)
    for i in range(args.warmup, args.warmup + args.steps):
        for method in turn_order(methods, i - args.warmup, per_round):
            runs[method].append(timed_step(i, *method))
    return runs


def turn_order(methods: list, step: int, per_round: int = 1) -> list:
    """The order the methods take their turns at measured ``step`` (0-based) of rounds of
    ``per_round`` batches: reversed on every other batch of a round and, for each batch, on every
    other round, so each method runs first on every batch equally often (over an even number of
    rounds; for one batch a round, on every other step)."""
    batch, round_ = step % per_round, step // per_round
    return list(reversed(methods)) if (batch + round_) % 2 else list(methods)


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
        # a step whose plan moved nothing ran locally: no byte counters ("auto" on a balanced step)
        dist.all_gather_object(sent, (sum(stats.get("rank_bytes_sent_this_step", {}).values()),
                                      stats.get("rank_saved_for_backward_bytes", 0),
                                      [r[3] for r in done]))  # each step's timeline events
        key = f"distca_{backward_mode}" if overlap == overlaps[0] else f"distca_{backward_mode}_{overlap}"
        results[key] = {
            "step_s": [r[0] for r in done], "stats": stats, "overlap": overlap,
            # each round's plan: attention imbalance before -> after, bytes, share of queries moved
            "plans": [{"before": imbalance(r[2]["attn_pairs_local"]), "after": imbalance(r[2]["attn_pairs_served"]),
                       "bytes_per_layer": r[2]["bytes_sent_per_layer"],
                       "moved_query_fraction": r[2]["moved_query_fraction"]} for r in done],
            "bytes_sent_per_step": sum(s[0] for s in sent),
            "saved_for_backward_bytes_max_rank": max(s[1] for s in sent),
            # one step's overlap over all ranks: their communication and blocked seconds summed
            "overlap_per_step": [overlap_summary([e for s in sent for e in s[2][i]]) for i in range(args.steps)],
        }
        if rank == 0 and args.trace and backward_mode == methods[1][1]:
            chrome_trace([s[2][-1] for s in sent], _trace_path(args.trace, overlap, len(overlaps)))
    return results


# --- --workload long: one document over every rank, against per-document CP, Ulysses, colocated ---


def default_long_tokens(world: int, tokens: int) -> int:
    """The long document's default length: all of the global batch but ``tokens / 2`` (short
    documents, half before it and half after)."""
    return world * tokens - tokens // 2


def long_documents(world: int, tokens: int, long_tokens: int, short_len: int) -> list[int]:
    """Document lengths of the global stream of ``world * tokens`` tokens: short documents of
    ``short_len`` tokens (the last of each run shorter), one of ``long_tokens`` starting in rank 0's
    row and ending in the last rank's, then short ones."""
    rest = world * tokens - long_tokens
    before, after = rest // 2, rest - rest // 2
    if not (0 <= rest and before < tokens and after < tokens):
        raise ValueError(f"--long-tokens {long_tokens} must be at most {world * tokens} and above "
                         f"{world * tokens - 2 * tokens + 1} so that the long document starts in rank 0's row "
                         f"and ends in rank {world - 1}'s ({world} ranks of {tokens} tokens)")

    def shorts(n):
        return [short_len] * (n // short_len) + ([n % short_len] if n % short_len else [])

    return shorts(before) + [long_tokens] + shorts(after)


def per_step_ratios(baseline: list[float], distca: list[float]) -> dict:
    """Per-step speedup of distca over a baseline (``baseline / distca``, steps of the same round)."""
    ratios = [b / d for b, d in zip(baseline, distca)]
    return {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios)}


class TensorMemory:
    """Tensor bytes allocated inside the ``with`` block: ``live`` now and their ``peak``.

    A ``TorchDispatchMode`` sees every op; an output whose storage is new (not one of the op's
    inputs': views, in-place ops) is counted until the storage is freed. Tensors that existed before
    (weights, inputs) are not counted. Works on any device; allocator caching and fragmentation are
    not included (on CPU there is no allocator counter to read)."""

    def __enter__(self):
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        tracker = self
        self.live = self.peak = 0
        sizes: dict[int, int] = {}

        def free(key):
            tracker.live -= sizes.pop(key)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if _is_tensor(t)}
                for t in tree_flatten(out)[0]:
                    storage = t.untyped_storage() if _is_tensor(t) else None
                    if storage is None or storage.nbytes() == 0 or storage.data_ptr() in inputs \
                            or storage.data_ptr() in sizes:
                        continue
                    sizes[storage.data_ptr()] = storage.nbytes()
                    tracker.live += storage.nbytes()
                    tracker.peak = max(tracker.peak, tracker.live)
                    weakref.finalize(storage, free, storage.data_ptr())
                return out

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


def _is_tensor(t) -> bool:
    import torch

    return isinstance(t, torch.Tensor)


class CommBytes:
    """Bytes this rank sends to other ranks through ``torch.distributed``'s all-to-all and
    all-gather calls inside the ``with`` block (distca, per-document CP and DeepSpeed all go
    through them): an all-to-all sends everything but its own split, an all-gather its input to
    every other rank."""

    NAMES = ("all_to_all_single", "all_gather", "all_gather_into_tensor")

    def __enter__(self):
        import inspect

        import torch.distributed as dist

        self.sent, self._saved = 0, {name: getattr(dist, name) for name in self.NAMES}
        for name, fn in self._saved.items():
            signature = inspect.signature(fn)

            def counting(*args, _fn=fn, _name=name, _signature=signature, **kwargs):
                self.sent += _bytes_sent(_name, _signature.bind(*args, **kwargs).arguments)
                return _fn(*args, **kwargs)

            setattr(dist, name, counting)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def _bytes_sent(name: str, a: dict) -> int:
    import torch.distributed as dist

    group = a.get("group")
    world, me = dist.get_world_size(group), dist.get_rank(group)
    if name == "all_to_all_single":
        rows = a["input"].shape[0] if a["input"].dim() else 0
        splits = a.get("input_split_sizes") or [rows // world] * world
        return (rows - splits[me]) * (a["input"].nbytes // max(rows, 1))
    sent = a["tensor"] if name == "all_gather" else a["input_tensor"]
    return (world - 1) * sent.nbytes


def _long_methods(rank: int, world: int, args, device) -> dict:
    """Per method: the distca settings, the attention implementation and this rank's inputs.
    colocated and distca hold the stream's slice ``[r T, (r + 1) T)``, as does Ulysses; per-document
    CP holds its head-tail layout of the same tokens."""
    import numpy as np
    import torch

    from . import context_parallel as cp

    lengths = long_documents(world, args.tokens, args.long_tokens, args.tokens // args.short_docs)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (sum(lengths),), generator=g)
    positions = torch.from_numpy(np.concatenate([np.arange(n) for n in lengths]))
    stream = cp.stream_segments(lengths, args.tokens, world)
    layout = cp.head_tail_segments(stream)
    sl = slice(rank * args.tokens, (rank + 1) * args.tokens)
    own = {"input_ids": ids[sl][None].to(device), "position_ids": positions[sl][None].to(device)}
    index = torch.from_numpy(cp.segment_tokens(layout[rank], lengths))
    local = {"mode": "colocated", "span_ranks": False}
    distca = {"mode": "distca", "span_ranks": True, "backward": "resend" if args.backward == "resend" else "saved",
              "overlap": args.overlap}
    methods = {
        "colocated": (local, "distca", own, cp.piece_pairs(stream), False),
        "distca": (distca, "distca", own, None, True),
        "cp": (local, cp.CP_IMPLEMENTATION, {"input_ids": ids[index][None].to(device),
                                             "position_ids": torch.from_numpy(cp.segment_positions(layout[rank]))[None]
                                             .to(device), "cp_plan": cp.cp_exchange(layout, rank, device)},
               cp.segment_pairs(layout), True),
    }
    if args.ulysses_skipped is None:
        total = sum(cp.segment_pairs(stream))  # every rank: all documents, heads / world of them
        methods["ulysses"] = (local, "distca_ulysses", own, [total / world] * world, True)
    return {name: dict(zip(("settings", "attn", "inputs", "pairs", "exact"), m)) for name, m in methods.items()}


def _long_step(model, method: dict, sent: CommBytes | None = None, memory: TensorMemory | None = None):
    """One forward + backward of ``method`` (already prepared). ``sent`` counts the forward's bytes;
    returns the live bytes of ``memory`` when the forward ends (what it keeps for backward)."""
    import contextlib

    model.zero_grad(set_to_none=True)
    with sent or contextlib.nullcontext():
        loss = model(**method["inputs"]).logits.float().square().mean()
    kept = memory.live if memory is not None else None
    loss.backward()
    return kept


def _prepare(model, method: dict, args) -> None:
    import distca_hf

    distca_hf.configure(tolerance=args.tolerance, **{"backward": "saved", "overlap": "none", **method["settings"]})
    if model.config._attn_implementation != method["attn"]:
        model.set_attn_implementation(method["attn"])


def _long_worker(rank: int, world: int, args, device) -> dict:
    """Every method in turns (``args.steps`` rounds after ``args.warmup``), then one measured step
    per method (bytes, memory); rank 0 gets every rank's measurements."""
    import torch
    import torch.distributed as dist

    import distca_hf

    from . import context_parallel as cp
    from .ulysses import register_ulysses

    model = bench_model(args, device, args.world * args.tokens)
    cp.register()
    if args.ulysses_skipped is None:
        register_ulysses(model, world)
        torch.set_num_threads(args.threads)
    methods = _long_methods(rank, world, args, device)
    for method in methods.values():
        _prepare(model, method, args)
        for _ in range(args.warmup):
            _long_step(model, method)
    steps = {name: [] for name in methods}
    for _ in range(args.steps):
        for name, method in methods.items():
            _prepare(model, method, args)
            _sync(device)
            dist.barrier()
            start = time.perf_counter()
            _long_step(model, method)
            _sync(device)
            dist.barrier()
            steps[name].append(time.perf_counter() - start)
    measured = {}
    for name, method in methods.items():
        _prepare(model, method, args)
        sent = CommBytes()
        with TensorMemory() as memory:
            kept = _long_step(model, method, sent, memory)
        measured[name] = {"sent": sent.sent, "peak": memory.peak, "kept": kept,
                          "stats": distca_hf.plan_stats() if name == "distca" else None}
    everyone = [None] * world
    dist.all_gather_object(everyone, measured)
    return {"workload": "long", "documents": long_documents(world, args.tokens, args.long_tokens,
                                                            args.tokens // args.short_docs),
            "methods": {name: _combine(name, methods[name], steps[name], [m[name] for m in everyone], args)
                        for name in methods}}


def _combine(name: str, method: dict, steps: list[float], ranks: list[dict], args) -> dict:
    """One method's result over all ranks: rank 0's step times (between barriers: the slowest
    rank's), bytes of one layer's forward summed over ranks, memory of the worst rank."""
    stats = ranks[0]["stats"]
    pairs = stats["attn_pairs_served"] if name == "distca" else method["pairs"]
    return {"step_s": steps, "exact": method["exact"], "attn_pairs": pairs, "stats": stats,
            "bytes_per_layer_forward": sum(r["sent"] for r in ranks) / args.layers,
            "peak_bytes_max_rank": max(r["peak"] for r in ranks),
            "kept_for_backward_bytes_max_rank": max(r["kept"] for r in ranks)}


def _trace_path(path: str, overlap: str, modes: int) -> str:
    if modes == 1:
        return path
    stem, dot, ext = path.rpartition(".")
    return f"{stem}.{overlap}.{ext}" if dot else f"{path}.{overlap}"


def _median_overlap(steps: list[dict]) -> dict:
    """The step with the median overlap fraction (its forward/backward split comes with it)."""
    ordered = sorted(steps, key=lambda d: d["overlap_fraction"])
    return ordered[len(ordered) // 2]


TARGETS = {"skewed": 1.4, "balanced": 0.98}
"""Median per-step speedup over colocated each workload must reach (issue 13) at the default sizes:
skewed >= 1.4x; balanced >= 0.98x, i.e. never slower beyond noise (``--quick`` reports none: its
steps are mostly linear layers)."""


def summarize(results: dict, args, workload: str = "skewed", *, center=statistics.median) -> dict:
    """One workload's JSON: the contract's keys, the per-step speedup of every distca setting over
    colocated (min / median / max over rounds), each round's plan, and the target when it has one.
    ``attn_imbalance_before`` / ``_after`` are means over rounds (every round's plan is the same
    batch for ``skewed`` and ``balanced``). ``center`` turns a method's step times into its step
    (``*_step_s``; the median, or for ``demo`` the mean: its steps are different batches)."""
    median, mean = center, statistics.fmean
    colocated = median(results["colocated"]["step_s"])
    ideal = median(results["ideal_step_s"])
    first = "distca_" + ("saved" if args.backward in ("saved", "both") else "resend")
    distca = median(results[first]["step_s"])
    plans = results[first]["plans"]
    summary = {
        "workload": workload,
        "colocated_step_s": colocated,
        "distca_step_s": distca,
        "speedup": colocated / distca,
        "attn_imbalance_before": mean(p["before"] for p in plans),
        "attn_imbalance_after": mean(p["after"] for p in plans),
        "ideal_step_s": ideal,
        "distca_over_ideal": distca / ideal,
        "ideal_speedup": colocated / ideal,
        "world": args.world,
        "device": args.device,
        "tokens_per_rank": args.tokens,
        "tolerance": args.tolerance,
        "bytes_sent_per_layer_forward": mean(p["bytes_per_layer"] for p in plans),
        "moved_query_fraction": mean(p["moved_query_fraction"] for p in plans),
        "overlap_mode": results[first]["overlap"],
        "overlap_fraction": _median_overlap(results[first]["overlap_per_step"])["overlap_fraction"],
        "per_step_speedup": {"colocated": per_step_ratios(results["colocated"]["step_s"], results[first]["step_s"])},
        "steps": {"colocated_step_s": results["colocated"]["step_s"], "distca_step_s": results[first]["step_s"],
                  "plans": plans},
    }
    if workload in TARGETS and not getattr(args, "quick", False):  # the targets are for the full sizes
        met = summary["per_step_speedup"]["colocated"]["median"] >= TARGETS[workload]
        summary["target"] = {"median_speedup_at_least": TARGETS[workload], "met": met}
    summary["overlap"] = {}
    for key, r in results.items():
        if key.startswith(first) and "overlap" in r:
            o = _median_overlap(r["overlap_per_step"])
            summary["overlap"][r["overlap"]] = {
                "step_s": median(r["step_s"]), "speedup_vs_colocated": colocated / median(r["step_s"]),
                "per_step_speedup": per_step_ratios(results["colocated"]["step_s"], r["step_s"]),
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
                "per_step_speedup": per_step_ratios(results["colocated"]["step_s"], r["step_s"]),
                "bytes_sent_per_step_all_ranks": r["bytes_sent_per_step"],
                "saved_for_backward_bytes_max_rank": r["saved_for_backward_bytes_max_rank"],
            }
    return summary


def per_batch_minimum(step_s: list[float], batches: int) -> list[float]:
    """Each batch's fastest round: ``step_s`` holds the rounds one after the other, ``batches`` steps
    each (``len(step_s)`` a multiple of ``batches``)."""
    rounds = len(step_s) // batches
    return [min(step_s[r * batches + b] for r in range(rounds)) for b in range(batches)]


def summarize_demo(results: dict, args) -> dict:
    """The ``--workload demo`` JSON: ``summarize``'s keys over the batches, each batch (a step of the
    demo) timed per method by its fastest round, so that ``colocated_step_s`` / ``distca_step_s`` are
    the mean step over the batches and ``speedup`` the whole run's (also ``whole_run_speedup``);
    ``per_step_speedup`` is over the batches, ``steps`` lists them (times, ratios, plans of the first
    measured round: every round plans the same batch alike), ``batches_more_than_3pct_slower`` counts
    the batches below 0.97x, and ``target`` (the demo's sizes only) says whether the run meets
    ``DEMO_TARGET``. The ideal is left out (see below)."""
    batches = args.demo_global_batches
    fastest = {"colocated": {"step_s": per_batch_minimum(results["colocated"]["step_s"], batches)},
               "ideal_step_s": per_batch_minimum(results["ideal_step_s"], batches)}
    for key, r in results.items():
        if key.startswith("distca_"):
            fastest[key] = {**r, "step_s": per_batch_minimum(r["step_s"], batches), "plans": r["plans"][:batches],
                            "overlap_per_step": r["overlap_per_step"][:batches]}
    summary = summarize(fastest, args, "demo", center=statistics.fmean)
    # No measured ideal: it assumes a colocated step communicates nothing, but here colocated sends
    # the prefix K/V of the documents that span ranks, and a rank's wait for it is no kernel time.
    for key in ("ideal_step_s", "distca_over_ideal", "ideal_speedup"):
        del summary[key]
    steps = summary["steps"]
    steps["speedup"] = [c / d for c, d in zip(steps["colocated_step_s"], steps["distca_step_s"])]
    least = DEMO_TARGET["per_step_speedup_at_least"]
    summary.update(rounds=args.steps, warmup_rounds=args.warmup, global_batches=batches,
                   packing=args.demo_packing, whole_run_speedup=summary["speedup"],
                   batches_more_than_3pct_slower=sum(r < least for r in steps["speedup"]))
    if demo_run_matches(args):
        whole = summary["whole_run_speedup"] >= DEMO_TARGET["whole_run_speedup_at_least"]
        every = summary["per_step_speedup"]["colocated"]["min"] >= least
        summary["target"] = {**DEMO_TARGET, "whole_run_met": whole, "per_step_met": every, "met": whole and every}
    return summary


def summarize_long(results: dict, args) -> dict:
    """The ``--workload long`` JSON: the contract's keys (``speedup`` is colocated-where-possible over
    distca), ``cp_step_s`` and ``speedup_vs_cp``, per baseline the per-step speedup of distca, and
    per method its step, bytes, memory, attention imbalance and exactness."""
    median, methods = statistics.median, results["methods"]
    distca = methods["distca"]
    stats = distca["stats"]
    docs = results["documents"]
    summary = {
        "workload": "long",
        "colocated_step_s": median(methods["colocated"]["step_s"]),
        "distca_step_s": median(distca["step_s"]),
        "cp_step_s": median(methods["cp"]["step_s"]),
        "attn_imbalance_before": imbalance(stats["attn_pairs_local"]),
        "attn_imbalance_after": imbalance(stats["attn_pairs_served"]),
        "world": args.world, "device": args.device, "tokens_per_rank": args.tokens, "long_tokens": args.long_tokens,
        "short_documents": len(docs) - 1, "short_tokens": args.tokens // args.short_docs,
        "distca_settings": {"backward": "resend" if args.backward == "resend" else "saved", "overlap": args.overlap},
        "per_step_speedup": {name: per_step_ratios(m["step_s"], distca["step_s"])
                             for name, m in methods.items() if name != "distca"},
        "methods": {name: {"step_s": median(m["step_s"]), "exact": m["exact"],
                           "bytes_per_layer_forward": m["bytes_per_layer_forward"],
                           "peak_bytes_max_rank": m["peak_bytes_max_rank"],
                           "kept_for_backward_bytes_max_rank": m["kept_for_backward_bytes_max_rank"],
                           "attn_imbalance": imbalance(m["attn_pairs"])} for name, m in methods.items()},
    }
    summary["speedup"] = summary["colocated_step_s"] / summary["distca_step_s"]
    summary["speedup_vs_cp"] = summary["cp_step_s"] / summary["distca_step_s"]
    summary["methods"]["distca"]["plan_bytes_sent_per_layer"] = stats["bytes_sent_per_layer"]
    summary["methods"]["distca"]["kv_tokens_received_max"] = stats["kv_tokens_received_max"]
    if args.ulysses_skipped is not None:
        summary["ulysses_skipped"] = args.ulysses_skipped
    return summary


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


QUICK = {"tokens": 2048, "steps": 3, "warmup": 1, "layers": 2}
"""What ``--quick`` changes (unless given): a check in about a minute on 2 CPU processes."""
DEFAULTS = {"tokens": 8192, "steps": 5, "warmup": 1, "layers": 4}
MODEL_DEFAULTS = {"hidden": 256, "intermediate": 688, "heads": 8, "kv_heads": 2}
"""The bench model's shape (with ``DEFAULTS``' layers) unless given; ``--workload demo``: ``DEMO_MODEL``."""


def _tolerance(text: str):
    """``--tolerance``: ``auto`` or a number >= 0 (the ``tolerance`` setting's check)."""
    from ..config import setting_problem

    value = "auto" if text == "auto" else float(text)
    problem = setting_problem("tolerance", value)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world", type=int, default=2, help="processes, one rank each (GPUs on a CUDA machine; "
                        "default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per rank (default 8192; --quick 2048)")
    parser.add_argument("--short-docs", type=int, default=None, help="documents on the odd (short) ranks of skewed "
                        "(default: tokens / 256); --workload long: short documents are tokens / short-docs tokens long")
    parser.add_argument("--hidden", type=int, default=None, help="the model's hidden size, elements per token "
                        "(default 256; --workload demo: 64)")
    parser.add_argument("--intermediate", type=int, default=None, help="the MLP's intermediate size, elements per "
                        "token (default 688; --workload demo: 128)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; --quick and --workload "
                        "demo: 2)")
    parser.add_argument("--heads", type=int, default=None, help="query heads (default 8; --workload demo: 2)")
    parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads, a divisor of --heads (default "
                        "2; --workload demo: 1)")
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary size, token ids (default: %(default)s)")
    parser.add_argument("--steps", "--rounds", dest="steps", type=int, default=None, help="measured rounds (default "
                        "5; --quick and --workload demo: 3, a demo round running every global batch once)")
    parser.add_argument("--warmup", type=int, default=None, help="rounds before measuring (default 1)")
    parser.add_argument("--quick", action="store_true",
                        help=f"small sizes for a check in about a minute: {QUICK} unless given")
    parser.add_argument("--backward", choices=["saved", "resend", "both"], default="saved",
                        help="distca's backward mode (the setting DISTCA_BACKWARD), or both to time each "
                        "(default: %(default)s)")
    parser.add_argument("--tolerance", type=_tolerance, default="auto",
                        help="distca's tolerance: 'auto' plans by time (the default setting), a number bounds "
                        "max/mean - 1 of attention load")
    parser.add_argument("--overlap", default="none",
                        help="none|wave|pingpong, or several separated by commas (the first gives distca_step_s)")
    parser.add_argument("--trace", metavar="OUT.json", help="write the last step's Chrome trace (one file per mode "
                        "when several: OUT.<mode>.json)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default: %(default)s)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: CUDA (NCCL, one GPU per process) when there is one, else CPU (gloo) "
                        "(default: %(default)s)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--timeout", type=float, default=600.0, help="process-group timeout in seconds (default: "
                        "%(default)s)")
    parser.add_argument("--json", action="store_true", help="print a JSON object")
    parser.add_argument("--workload", default="skewed",
                        help="skewed: even ranks one long document, odd ranks many short; balanced: every rank's "
                        "attention within a few percent; mixed: each round a batch drawn from the demo's document "
                        "lengths; sample:FILE.json: drawn from a JSON list of lengths; several separated by commas run "
                        "one after the other; long (alone): one document over every rank beside short ones, against "
                        "per-document CP, Ulysses and colocated-where-possible; demo (alone): make demo's own global "
                        "batches (its documents and packing, documents spanning ranks, its model), each batch timed by "
                        "its fastest round, the whole run's speedup and the batches more than 3%% slower")
    parser.add_argument("--global-batches", type=int, default=None,
                        help="--workload demo: run only the first N of the demo's global batches (default: all)")
    parser.add_argument("--long-tokens", type=int, default=None,
                        help="--workload long: the long document's tokens (default: world x tokens - tokens / 2)")
    parser.add_argument("--no-ulysses", action="store_true", help="--workload long: leave DeepSpeed Ulysses out")
    parser.add_argument("--pipeline-parallel", type=int, default=None, metavar="P",
                        help="pipeline stages (world / P data-parallel copies each): torch's stock 1F1B with colocated "
                        "attention against 1F1B with CAD per stage and cad_1f1b (CAD across stages), side by side; "
                        "see distca_hf/tools/bench_pipeline.py (its defaults: --tokens 6144 --micro-batches 4 --layers 2 "
                        "--hidden 128 --intermediate 344 --heads 4)")
    parser.add_argument("--micro-batches", type=int, default=None, metavar="M",
                        help="--pipeline-parallel: micro-batches per step, one packed row of --tokens each per copy "
                        "(default 4)")


def check_workload_names(args, parser) -> None:
    """``--workload``: known names or ``sample:FILE.json`` (readable, a list of lengths); ``long``
    only alone."""
    names = args.workload.split(",")
    for name in names:
        if name.startswith("sample:"):
            try:
                sample_lengths(name)
            except ValueError as e:
                parser.error(str(e))
        elif name not in WORKLOADS:
            parser.error(f"--workload takes {', '.join(WORKLOADS)} or sample:FILE.json (several separated by commas), "
                         f"got {name!r}")
    for name, why in ALONE.items():
        if name in names and len(names) > 1:
            parser.error(f"--workload {name} runs alone ({why})")
    if len(set(names)) != len(names):
        parser.error(f"--workload names a workload twice: {args.workload!r}")


def _check_long(args, parser) -> None:
    """``--workload long``: the long document's length, one distca setting, whether Ulysses runs."""
    args.ulysses_skipped = "--no-ulysses" if args.no_ulysses else None
    if args.workload != "long":
        return
    if args.long_tokens is None:
        args.long_tokens = default_long_tokens(args.world, args.tokens)
    try:
        long_documents(args.world, args.tokens, args.long_tokens, args.tokens // args.short_docs)
    except ValueError as e:
        parser.error(str(e))
    if args.backward == "both" or "," in args.overlap or args.trace:
        parser.error("--workload long runs one distca setting: --backward saved|resend, one --overlap, no --trace")
    if args.ulysses_skipped is None:
        from .ulysses import ulysses_unavailable

        args.ulysses_skipped = ulysses_unavailable(args.world, args.heads, args.kv_heads)


def _check_demo(args, parser) -> None:
    """``--workload demo``: the demo's documents (tokenized here, once: the ranks get the lengths),
    their packing for ``--world`` ranks of ``--tokens``, and ``--global-batches``."""
    if args.workload != "demo":
        if args.global_batches is not None:
            parser.error("--global-batches is for --workload demo")
        return
    try:
        args.demo_lengths, args.demo_pad_token_id = demo_document_lengths()
    except ImportError as e:
        parser.error(f"--workload demo: {e}")
    from ..training.packing import pack_rows

    _, report = pack_rows(args.demo_lengths, demo_packing_config(args.tokens, args.demo_pad_token_id),
                          group_size=args.world)
    args.demo_packing = str(report)
    args.demo_global_batches = report.global_batches
    if args.global_batches is not None:
        if not 1 <= args.global_batches <= report.global_batches:
            parser.error(f"--global-batches must be between 1 and {report.global_batches} (the demo's global batches "
                         f"of {args.world} x {args.tokens} tokens), got {args.global_batches}")
        args.demo_global_batches = args.global_batches


def launch(worker, args):
    """Run ``worker(rank, world, args, port, result_path)`` on every rank (``args.world`` spawned
    processes, or this one under torchrun) and return what rank 0 wrote to ``result_path`` (JSON);
    ``None`` on the other ranks under torchrun."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.json")
        if "WORLD_SIZE" in os.environ and "RANK" in os.environ:  # under torchrun
            args.world = int(os.environ["WORLD_SIZE"])
            rank = int(os.environ["RANK"])
            worker(rank, args.world, args, int(os.environ.get("MASTER_PORT", 29500)), path if rank == 0 else None)
            if rank != 0:
                return None
        else:
            from ..runtime.comm import free_port

            mp.start_processes(worker, args=(args.world, args, free_port(), path), nprocs=args.world,
                               start_method="spawn")
        with open(path) as f:
            return json.load(f)


def run_cli(args, parser) -> int:
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.pipeline_parallel is not None:  # pipeline stages: their own methods and sizes
        from .bench_pipeline import run_pipeline_cli

        return run_pipeline_cli(args, parser)
    if args.micro_batches is not None:
        parser.error("--micro-batches is for --pipeline-parallel")
    if args.workload == "demo":  # the demo's model and rounds, unless given
        for name, value in {**DEMO_MODEL, "steps": DEMO_ROUNDS}.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
    for name, value in MODEL_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name, value in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, QUICK[name] if args.quick else value)
    if args.short_docs is None:
        args.short_docs = max(1, args.tokens // 256)  # short documents of 256 tokens
    check_workload_names(args, parser)
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    for name in ("world", "tokens", "short_docs", "layers", "steps", "threads", "hidden", "intermediate", "heads",
                 "kv_heads"):
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
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:  # under torchrun
        args.world = int(os.environ["WORLD_SIZE"])
    _check_long(args, parser)
    _check_demo(args, parser)
    results = launch(_worker, args)
    if results is None:  # a rank other than 0 under torchrun
        return 0
    if args.workload == "long":
        summary = summarize_long(results, args)
        print(json.dumps(summary) if args.json else format_long_table(summary))
        return 0
    summaries = {name: summarize_demo(r, args) if name == "demo" else summarize(r, args, name)
                 for name, r in results.items()}
    if len(summaries) == 1:  # the contract's flat object
        summary = next(iter(summaries.values()))
        print(json.dumps(summary) if args.json else format_table(summary))
    else:
        print(json.dumps({"workloads": summaries}) if args.json
              else "\n\n".join(format_table(s) for s in summaries.values()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``distca-hf bench`` argument parser."""
    parser = argparse.ArgumentParser(prog="distca-hf bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    return run_cli(parser.parse_args(argv), parser)


if __name__ == "__main__":
    sys.exit(main())
