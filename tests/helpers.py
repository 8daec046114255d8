"""Shared test helpers: tiny random models and the independent per-document reference."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

import distca_hf  # noqa: F401  (registers "distca")

VOCAB = 96


def tiny_config(family: str, **overrides):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "mistral":
        # A window at least as long as every test document: exact, so it must be accepted.
        return MistralConfig(**{"sliding_window": 64, **common})
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "qwen3":
        return Qwen3Config(**{"head_dim": 8, **common})
    if family in ("deepseek_v3", "deepseek_v2"):
        # multi-head latent attention: q/k head dim 16 + 8 (rope) = 24, v head dim 12; a dense and an MoE layer
        mla = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
                   v_head_dim=12, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                   n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1)
        return AutoConfig.for_model(family, **{**common, **mla, **overrides})
    if family == "llama4":
        # chunked layers (chunk 5, shorter than most test documents) and one full NoPE layer; one MoE layer
        llama4 = dict(head_dim=8, attention_chunk_size=5, intermediate_size_mlp=64, num_hidden_layers=4,
                      num_local_experts=2, num_experts_per_tok=1, moe_layers=[1])
        return AutoConfig.for_model("llama4_text", **{**common, **llama4, **overrides})
    raise ValueError(family)


FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def tiny_model(family: str, attn: str = "distca", seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), attn_implementation=attn,
                                             dtype=torch.float32)
    return model.train()


def objective_weights(shape, seed: int = 1234) -> torch.Tensor:
    """A fixed random projection of the logits: an objective whose gradient touches every logit."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g)


def param_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def per_document_reference(model, docs: list[torch.Tensor], weights: list[torch.Tensor]):
    """Each document alone through ``model`` with eager attention.

    docs: list of ``[n_i]`` token tensors; weights: list of ``[n_i, vocab]`` objective weights.
    Returns (list of ``[n_i, vocab]`` logits, parameter gradients of sum_i <logits_i, weights_i>).
    """
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    model.zero_grad(set_to_none=True)
    try:
        logits = [model(input_ids=d.unsqueeze(0), use_cache=False).logits[0] for d in docs]
        sum((lg * w).sum() for lg, w in zip(logits, weights)).backward()
        return [lg.detach() for lg in logits], param_grads(model)
    finally:
        model.set_attn_implementation(previous)
        model.zero_grad(set_to_none=True)


def assert_grads_close(actual: dict, expected: dict, atol=1e-5, rtol=1e-4):
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


def cli_in_process(*args):
    """Run ``distca-hf ARGS`` in this process (a console-script start costs seconds); returns a
    ``subprocess.CompletedProcess`` with the exit code and the captured stdout and stderr."""
    import contextlib
    import io
    import subprocess

    from distca_hf.tools.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:
            code = e.code
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def accelerate_launch(*arguments, timeout: float = 300, env: dict | None = None):
    """``accelerate launch ARGUMENTS`` from the repository root in its own process group, killed whole
    (launcher and ranks) on timeout, which fails the test. ``env``: variables added to this process's
    (its launcher variables removed). Returns a ``subprocess.CompletedProcess`` with text output."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    accelerate = Path(sys.executable).parent / "accelerate"
    launch_env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    launch_env.update(env or {})
    process = subprocess.Popen([str(accelerate), "launch", *map(str, arguments)], cwd=Path(__file__).resolve().parents[1],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=launch_env,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"accelerate launch {' '.join(map(str, arguments))} did not finish in {timeout}s:\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def assert_trained_like_reference(rank_losses: list, trained: dict, losses: list, params: dict):
    """A multi-rank training run equals the single-process reference: every rank's per-step
    ``rank_losses`` (a list per rank) equal ``losses`` (fp32: rtol 1e-5), and the ``trained``
    parameters (name -> tensor, gathered whole) equal ``params``."""
    for per_step in rank_losses:
        torch.testing.assert_close(torch.tensor(per_step), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    assert trained.keys() == params.keys()
    for name in params:
        torch.testing.assert_close(trained[name], params[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


# ---- transformers renamed gradient checkpointing to activation checkpointing (5.24); a lent GPU machine
# has 5.17, so the tests say it through these (the package itself accepts both names) ----

def checkpointing_enable(model, **checkpoint_kwargs) -> None:
    """Activation checkpointing on an HF model (or a pipeline stage) under the installed name;
    ``checkpoint_kwargs`` go to ``torch.utils.checkpoint`` (``use_reentrant=False``...)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=checkpoint_kwargs or None)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs or None)


def checkpointing_disable(model) -> None:
    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()


def is_checkpointing(model) -> bool:
    flag = getattr(model, "is_activation_checkpointing", None)
    return bool(model.is_gradient_checkpointing if flag is None else flag)


def checkpointing_argument(enabled: bool) -> dict:
    """``TrainingArguments`` keyword that turns activation checkpointing on (5.24) or its older name."""
    import dataclasses

    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return {"activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing": enabled}


def shifted_target_losses(logits, labels):
    """``preprocess_logits_for_metrics`` of the usual causal-LM recipe (logit t against label t + 1):
    ``[rows, tokens - 1, 2]``, per position its cross-entropy and 1 where the label is a target (0 else)."""
    targets = labels[:, 1:]
    counted = targets != -100
    losses = torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), targets.clamp(min=0), reduction="none")
    return torch.stack([losses * counted, counted.float()], dim=-1)


def shifted_target_metrics(prediction):
    """``compute_metrics``: the summed loss and the count of the targets the usual recipe meets (the
    Trainer pads what it gathers with -100: only entries marked 1 count)."""
    values = torch.as_tensor(prediction.predictions).reshape(-1, 2)
    counted = values[:, 1] == 1
    metrics = {"recipe_loss_sum": float(values[counted, 0].sum()), "recipe_targets": int(counted.sum())}
    if prediction.inputs is not None:  # include_for_metrics=["inputs"]: one width with the labels
        metrics["recipe_inputs_shape_matches"] = tuple(prediction.inputs.shape) == tuple(prediction.label_ids.shape)
    return metrics


def shifted_target_recipe() -> dict:
    """The trainer arguments of the usual causal-LM metrics recipe (``shifted_target_losses``,
    ``shifted_target_metrics``): ``eval_recipe_loss_sum`` and ``eval_recipe_targets`` in its metrics."""
    return {"compute_metrics": shifted_target_metrics, "preprocess_logits_for_metrics": shifted_target_losses}
