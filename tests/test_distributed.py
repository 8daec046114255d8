"""Distributed CAD on spawned gloo ranks: every rank's logits and parameter gradients equal its own
per-document eager reference, whatever the plan moved, in both backward modes, with and without
gradient checkpointing, over consecutive steps; plan_stats shows the balance; a dead or hung peer
raises a clear distca error instead of hanging."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_harness import run_ranks
from workers import check_forward_bytes, documents_for, exact_runs, exactness_worker

@pytest.mark.distributed
@pytest.mark.parametrize("world, family", [(2, "llama"), (3, "qwen3"), (4, "llama")])
def test_dispatch_is_exact(tmp_path, world, family):
    results = run_ranks(exactness_worker, world, tmp_path, family, env={"DISTCA_TOLERANCE": "0.02"})
    for rank, runs in exact_runs(results, 8):
        for run in runs:
            stats = run["stats"]
            assert stats["dispatched"] and stats["backward"] == run["backward"]
            local, served = np.array(stats["attn_pairs_local"]), np.array(stats["attn_pairs_served"])
            assert len(local) == world and local.sum() == served.sum()
            if local.max() / local.mean() >= 1.5:
                assert served.max() / served.mean() <= 1.05, (rank, run)
            assert stats["bytes_sent_per_layer"] > 0
    # every rank saw the same plan
    for i in range(len(results[0]["value"]) - 1):
        plans = {str(r["value"][i]["stats"]["attn_pairs_served"]) for r in results}
        assert len(plans) == 1
    check_forward_bytes(results)


def _hang_worker(rank, world, how, folder):
    import distca_hf
    from helpers import tiny_model

    released, woke = Path(folder, "released"), Path(folder, "woke")
    model = tiny_model("llama")
    if rank == 1:
        def stop(*_):
            if how == "die":
                os._exit(3)
            # hang until rank 0 has given up on it (never on a clock: a loaded machine may be slow)
            give_up = time.monotonic() + 120
            while not released.exists() and time.monotonic() < give_up:
                time.sleep(0.05)
            woke.touch()

        model.model.layers[1].register_forward_pre_hook(stop)
    docs = documents_for(rank, world, 0)
    ids = torch.cat(docs).unsqueeze(0)
    pos = torch.cat([torch.arange(len(d)) for d in docs]).unsqueeze(0)
    start = time.perf_counter()
    try:
        model(input_ids=ids, position_ids=pos)
    except distca_hf.DistCATimeoutError as e:
        seconds, peer_woke = time.perf_counter() - start, woke.exists()
        return {"error": str(e), "seconds": seconds, "peer_woke": peer_woke}
    finally:
        released.touch()
    return {"error": None}


@pytest.mark.distributed
@pytest.mark.parametrize("how", ["die", "hang"])
def test_dead_or_hung_peer_raises_a_clear_error(tmp_path, how):
    # tolerance 0.02: the plan moves work, so every layer exchanges (under "auto" a plan that moves
    # nothing computes locally, and a dead peer is found at the next forward's opening collective)
    results = run_ranks(_hang_worker, 2, tmp_path, how, str(tmp_path),
                        env={"DISTCA_TIMEOUT_S": "4", "DISTCA_TOLERANCE": "0.02"},
                        deadline_s=180, peer_wait_s=0)  # (only rank 0's result counts)
    rank0 = results[0]
    assert rank0["ok"], rank0.get("traceback")
    message = rank0["value"]["error"]
    assert message is not None, "rank 0 finished a step its peer never joined"
    assert "distca" in message and "forward" in message and "DISTCA_TIMEOUT_S" in message
    # the timeout ended the wait, not the peer (which hangs until rank 0 has raised), and not before 4 s
    # (a dead peer's closed connection may be found sooner)
    assert not rank0["value"]["peer_woke"] and (how == "die" or rank0["value"]["seconds"] >= 4)


def test_plan_stats_before_any_forward():
    import importlib

    from distca_hf.state import STATE

    saved = STATE.forward
    STATE.forward = None
    try:
        with pytest.raises(RuntimeError, match="no forward"):
            importlib.import_module("distca_hf").plan_stats()
    finally:
        STATE.forward = saved


@pytest.mark.distributed
def test_bench_cli_contract(tmp_path):
    """`distca-hf bench --json` on two real processes (tiny sizes): the contract's keys, and in the
    Chrome traces of `--trace` what each overlap mode does with an exchange between its launch and its
    wait (an order of events, not a timing)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).parent / "distca-hf"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "distca_hf"]
    result = subprocess.run([*cmd, "bench", "--tokens", "512", "--short-docs", "8", "--layers", "1", "--hidden", "64",
                             "--intermediate", "128", "--steps", "2", "--warmup", "1", "--overlap", "none,pingpong",
                             "--tolerance", "0.02", "--json", "--trace", str(tmp_path / "step.json")],
                            # (a fixed tolerance: these tiny steps must dispatch)
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    for key in ("colocated_step_s", "distca_step_s", "speedup", "attn_imbalance_before", "attn_imbalance_after"):
        assert isinstance(out[key], float) and out[key] > 0
    assert out["attn_imbalance_before"] > 1.5 and out["attn_imbalance_after"] <= 1.05
    assert out["speedup"] == pytest.approx(out["colocated_step_s"] / out["distca_step_s"])
    assert out["overlap_mode"] == "none" and set(out["overlap"]) == {"none", "pingpong"}
    assert out["overlap"]["none"]["step_s"] == out["distca_step_s"]
    for mode in out["overlap"].values():  # fractions of real communication time
        assert mode["comm_s_all_ranks"] > 0 and mode["step_s"] > 0
        for key in ("overlap_fraction", "forward_overlap_fraction", "backward_overlap_fraction"):
            assert 0.0 <= mode[key] <= 1.0
    # without overlap every exchange is waited on right after its launch; ping-pong computes the other
    # nano-batch in between (the fractions above are wall-clock and noisy on a loaded machine: not asserted)
    assert _computed_while_exchanging(tmp_path / "step.none.json") == 0
    assert _computed_while_exchanging(tmp_path / "step.pingpong.json") > 0


def _computed_while_exchanging(trace_path) -> int:
    """How many (exchange, compute span) pairs of a `bench --trace` Chrome trace have the compute span
    start on the same rank after the exchange's launch and before the rank starts waiting for it."""
    import json

    spans = [e for e in json.loads(trace_path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert any(e["cat"].startswith("comm") for e in spans), f"{trace_path} has no exchange"
    waits = {}  # (rank, exchange name) -> when the rank started waiting for it, each time
    for e in spans:
        if e["cat"].startswith("wait"):
            waits.setdefault((e["pid"], e["name"].removeprefix("wait: ")), []).append(e["ts"])
    count = 0
    for comm in (e for e in spans if e["cat"].startswith("comm")):
        # its wait: the first of that name from its launch on (a name recurs in later layers)
        waited = min(t for t in waits[comm["pid"], comm["name"]] if t >= comm["ts"])
        count += sum(1 for e in spans if e["cat"].startswith("compute") and e["pid"] == comm["pid"]
                     and comm["ts"] <= e["ts"] < waited)
    return count


def test_bench_rejects_bad_arguments(capsys, tmp_path):
    from distca_hf.tools.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "--world", "1"])
    assert "--world must be >= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--overlap", "none,sometimes"])
    assert "--overlap takes distinct values" in capsys.readouterr().err
    for flags, says in ((["--timeout", "nan"], "--timeout: must be a number of seconds from 0.001"),
                        (["--timeout", "-5"], "--timeout: must be a number of seconds from 0.001"),
                        # 0 ms: c10d's "no timeout", a hang where a peer died, before
                        (["--timeout", "1e-300"], "--timeout: must be a number of seconds from 0.001"),
                        (["--tolerance", "sometimes"], "--tolerance: must be a finite number >= 0")):
        with pytest.raises(SystemExit):
            main(["bench", *flags])
        assert says in capsys.readouterr().err
    from distca_hf.tools.bench.cli import build_parser  # the variables' spelling rule: AUTO as auto

    assert build_parser().parse_args(["--tolerance", " AUTO "]).tolerance == "auto"
    for command, flags, says in (("kernel-bench", ["--heads", "0"], "--heads must be >= 1, got 0"),
                                 ("kernel-bench", ["--repeats", "0"], "--repeats must be >= 1, got 0"),
                                 ("kernel-bench", ["--out", "/no/such/folder/x.json"], "--out: the folder of"),
                                 ("profile", ["--kv-heads", "0"], "--kv-heads must be >= 1, got 0"),
                                 ("profile", ["--device", "tpu"], "--device must be"),
                                 ("profile", ["--device", "cpu:5"], "--device must be cpu, cuda or cuda:N, got 'cpu:5'"),
                                 ("profile", ["--device", ""], "--device must be cpu, cuda or cuda:N, got ''"),
                                 ("bench", ["--workload", "demo", "--tokens", "1"], "--tokens must be at least 2 for "
                                  "--workload demo"),
                                 # a segfault, a CUDA candidate dropped, outputs failing after the run, 0 read as
                                 # the default, a huge world spawned: before
                                 ("kernel-bench", ["--device", "cpu", "--threads", "100000"],
                                  "--threads must be at most this machine's"),
                                 ("kernel-bench", ["--device", "cpu", "--candidate", "flash_attn"],
                                  "--candidate flash_attn is not a cpu candidate"),
                                 ("kernel-bench", ["--out", str(tmp_path)], "is a folder; name a file in it"),
                                 ("kernel-bench", ["--out", "/proc/x.json"], "--out: cannot write /proc/x.json"),
                                 ("profile", ["--out", "/proc/x.json"], "--out: cannot write /proc/x.json"),
                                 # flags that timed nothing (an empty table's traceback, or silently)
                                 ("kernel-bench", ["--device", "cpu", "--workload", "mixed_as_512_shards", "--flex"],
                                  "--flex times whole-document workloads only"),
                                 ("kernel-bench", ["--device", "cpu", "--workload", "mixed_as_512_shards",
                                                   "--candidate", "dense_packed_sdpa"],
                                  "dense_packed_sdpa masks whole documents only"),
                                 ("profile", ["--max-tokens", "0"], "--max-tokens must be >= 64, got 0"),
                                 ("profile", ["--repeats", "0"], "--repeats must be >= 1, got 0"),
                                 ("profile", ["--world", "100000"], "processes per CPU core"),
                                 ("profile", ["--out", str(tmp_path)], "is a folder; name a file in it"),
                                 ("bench", ["--vocab", "0"], "--vocab must be >= 1, got 0"),
                                 # spawned 100000 workers, or overflowed in each of them, before
                                 ("bench", ["--world", "100000"], "processes per CPU core of this machine"),
                                 ("bench", ["--threads", "100000"], "--threads must be at most this machine's"),
                                 ("bench", ["--pipeline-parallel", "2", "--world", "4000"], "processes per CPU core"),
                                 # a model no process here can hold: killed by the OS before (on CPU, often silently)
                                 ("bench", ["--layers", "1000000"], "--vocab and --tokens: the model needs at least"),
                                 ("bench", ["--pipeline-parallel", "2", "--vocab", str(10**12)], "GiB per process"),
                                 ("kernel-bench", ["--head-dim", str(10**30)], "--head-dim must be at most 4096"),
                                 ("bench", ["--tokens", str(10**12)], "--world x --tokens = 2000000000000 tokens"),
                                 ("bench", ["--trace", "/no/such/folder/t.json"], "--trace: the folder of"),
                                 ("bench", ["--long-tokens", "5"], "--long-tokens is for --workload long"),
                                 ("bench", ["--no-ulysses"], "--no-ulysses is for --workload long"),
                                 ("bench", ["--workload", "balanced", "--short-docs", "4"],
                                  "--short-docs is for --workload skewed or long (got --workload balanced)")):
        with pytest.raises(SystemExit):
            main([command, *flags])
        assert says in capsys.readouterr().err, (command, flags)


def _agreement_worker(rank, world):
    """Situations where ranks could fall out of step; every rank must decide the same thing."""
    import distca_hf
    from distca_hf import DistCAPeerError
    from helpers import tiny_model

    report = {}

    def outcome(fn):
        try:
            fn()
            return "ok"
        except (ValueError, RuntimeError) as e:
            return type(e).__name__

    # a. full + sliding layers (one mask per layer type) with padding on one rank only: one plan, exact
    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=1, num_hidden_layers=3)
    g = torch.Generator().manual_seed(rank)
    if rank == 0:
        ids, mask = torch.randint(1, 96, (2, 20), generator=g), torch.ones(2, 20, dtype=torch.long)
        mask[1, 15:] = 0
        docs = [ids[0], ids[1, :15]]
    else:
        ids, mask = torch.randint(1, 96, (1, 30), generator=g), None
        docs = [ids[0]]
    from distca_hf.runtime.context import current_forward

    steps_before = distca_hf.plan_stats()["step"] if current_forward() is not None else 0
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        report["plans_in_one_forward"] = distca_hf.plan_stats()["step"] - steps_before
        model.set_attn_implementation("eager")
        alone = [model(input_ids=d[None]).logits[0] for d in docs]
        model.set_attn_implementation("distca")
    got = [logits[0], logits[1, :15]] if rank == 0 else [logits[0]]
    report["mixed_err"] = max(float((a - b).abs().max()) for a, b in zip(got, alone))

    # b. a document longer than a sliding window on one rank: exact since windows are (tests/test_variants.py)
    mistral = tiny_model("mistral")  # window 64
    report["window"] = outcome(lambda: mistral(input_ids=torch.randint(1, 96, (1, 100 if rank == 0 else 30))))
    # c. invalid position_ids on one rank: it names its problem, the others stop with a peer error
    bad = torch.tensor([[0, 1, 2, 5, 6, 7]]) if rank == 1 else torch.arange(6)[None]
    report["invalid"] = outcome(lambda: mistral(input_ids=torch.arange(6)[None], position_ids=bad))
    # d. different settings on the ranks
    distca_hf.configure(tolerance=0.3 if rank == 1 else 0.02)
    report["settings"] = outcome(lambda: mistral(input_ids=torch.arange(6)[None]))
    distca_hf.reset_config()
    # d2. one rank colocated, the other distca, a document spanning both: their exchanges would not match
    distca_hf.configure(mode="colocated" if rank == 0 else "distca", span_ranks=True)
    try:
        mistral(input_ids=torch.arange(6)[None], position_ids=torch.arange(6)[None] + 6 * rank)
        report["modes"] = "ok"
    except ValueError as e:  # (a gloo size mismatch that killed a rank, or a timeout, before)
        report["modes"] = str(e)
    distca_hf.reset_config()
    # d3. ranks in different dtypes of one element size, or one rank without gradients: every rank names it
    # (the bfloat16 rank read the float16 rank's bytes as its own and got garbage, silently; the gradient-less
    # rank left the other waiting in its backward until DISTCA_TIMEOUT_S)
    half = tiny_model("llama").to(torch.float16 if rank == 0 else torch.bfloat16)
    try:
        half(input_ids=torch.arange(6)[None])
        report["dtypes"] = "ok"
    except ValueError as e:
        report["dtypes"] = str(e)
    adapter_like = tiny_model("mistral")  # trains v_proj only: the first layer's queries and keys need no gradient
    for name, parameter in adapter_like.named_parameters():
        parameter.requires_grad_("v_proj" in name)
    try:
        with torch.set_grad_enabled(rank == 1):
            adapter_like(input_ids=torch.arange(6)[None])
        report["grad_modes"] = "ok"
    except ValueError as e:
        report["grad_modes"] = str(e)
    # e. generation on every rank, different prompts and lengths: each rank generates alone
    llama = tiny_model("llama").eval()
    prompt = torch.randint(1, 96, (1, 9 if rank == 0 else 4), generator=g)
    with torch.no_grad():
        ours = llama.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
        llama.set_attn_implementation("eager")
        theirs = llama.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    report["generate_equal"] = bool(torch.equal(ours, theirs))
    # f. first attention layer is not layer 0, and one rank reuses its input tensors
    shifted = tiny_model("llama")
    for layer in shifted.model.layers:
        layer.self_attn.layer_idx += 1
    docs = documents_for(rank, world, 0)
    ids = torch.cat(docs).unsqueeze(0)
    pos = torch.cat([torch.arange(len(d)) for d in docs]).unsqueeze(0)
    errs = []
    for _ in range(2):
        if rank == 1:
            ids, pos = ids.clone(), pos.clone()
        with torch.no_grad():
            errs.append(shifted(input_ids=ids, position_ids=pos, use_cache=False).logits[0])
    shifted.set_attn_implementation("eager")
    with torch.no_grad():
        alone = torch.cat([shifted(input_ids=d[None], use_cache=False).logits[0] for d in docs])
    report["shifted_err"] = max(float((e - alone).abs().max()) for e in errs)
    # g. models whose layers slide with other windows on each rank (their plans would cut K/V to other
    # keys: a gloo abort before), and a mixed model beside one whose layers are all full
    for name, model in (("windows", tiny_model("mistral", sliding_window=4 if rank == 0 else 6)),
                        ("mixed_beside_full", tiny_model("qwen2", use_sliding_window=rank == 0, sliding_window=6,
                                                         max_window_layers=1, num_hidden_layers=3))):
        try:
            with torch.no_grad():
                model(input_ids=torch.randint(1, 96, (1, 20), generator=g))
            report[name] = "ok"
        except ValueError as e:
            report[name] = str(e)
    report["peer_error_type"] = DistCAPeerError.__name__
    return report


@pytest.mark.distributed
def test_ranks_agree_on_every_decision(tmp_path):
    results = run_ranks(_agreement_worker, 2, tmp_path, env={"DISTCA_TIMEOUT_S": "90"}, deadline_s=240)
    for r in results:
        assert r["ok"], r.get("traceback", r["error"])
    r0, r1 = results[0]["value"], results[1]["value"]
    for report in (r0, r1):
        assert report["plans_in_one_forward"] == 1
        assert report["mixed_err"] < 1e-5
        assert report["window"] == "ok"
        assert report["settings"] == "ValueError"
        assert "ranks use different settings" in report["modes"] and "mode" in report["modes"]
        assert "attention calls differ in dtype (rank 0: float16, 4 / 2 heads" in report["dtypes"], report["dtypes"]
        assert "rank 1: bfloat16" in report["dtypes"] and "gradients" not in report["dtypes"].split("(")[0]
        assert "differ in needs gradients" in report["grad_modes"] and "rank 1: float32" in report["grad_modes"]
        assert report["generate_equal"]
        assert report["shifted_err"] < 1e-5
        assert "differ in window of every layer" in report["windows"], report["windows"]
        assert "every layer's window 4" in report["windows"] and "every layer's window 6" in report["windows"]
        assert "differ in sliding layers' window" in report["mixed_beside_full"], report["mixed_beside_full"]
    assert r1["invalid"] == "DocumentBoundaryError" and r0["invalid"] == "DistCAPeerError"


def test_allocation_failures_are_told_from_other_errors():
    """profile and kernel-bench name their sizing flags when torch cannot allocate (a traceback before), and
    only then: another RuntimeError stays what it is."""
    from distca_hf.tools.machine_limits import out_of_memory

    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried to "
                       "allocate 25600000000 bytes")
    cuda = RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB")
    assert out_of_memory(cpu) and out_of_memory(cuda) and out_of_memory(MemoryError())
    assert not out_of_memory(RuntimeError("shape '[2, 3]' is invalid for input of size 5"))
