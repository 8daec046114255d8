"""Training: everything between a dataset and ``trainer.train()``.

    plugin         DistCAPlugin: the job's distca settings (code > DISTCA_* > YAML) and process groups
    topology       data x pipeline x tensor topology, attention-server groups (pure)
    packing        documents -> one packed row per rank and forward (global batches shared by a server
                   group's ranks when documents span ranks), the sampler that keeps them together,
                   the collator
    loading        files, folders, Hub names -> token-id documents
    offline_corpus the demo's offline documents (Python's help topics) and the BPE trained on them
    launch_checks  launched vs running processes, the CPU launch traps
    accelerator    DistCAAccelerator and the model checks every entry point runs
    global_batches what a Trainer subclass does when a server group shares global batches (span_ranks in
                   force while it runs, the sampler, the exact evaluation loss): DistCATrainer's and TRL's
    resume_layout  what a checkpoint's run read (processes, packing, dataset, accumulation, seed), so that a
                   resume that would read other rows is refused naming what changed
    trainer        DistCATrainer and its step table
    pipeline_trainer PipelineTrainerMixin: what DistCATrainer does in pipeline stages (the model split into
                   this rank's stage, rows read alike by a pipeline's stages, a step's micro-batches through
                   PipelineRunner, per-stage checkpoints, the refused settings)
    arguments      DistCAArguments: the distca settings as command-line flags (``HfArgumentParser``)
    trl            DistCASFTTrainer: TRL's SFTTrainer packing global batches over the server group
    pipeline_stages an HF causal LM split into pipeline stages (even layer split, tied embeddings, static
                   shapes for torch.distributed.pipelining, one save_pretrained folder from the stages)
    pipeline       PipelineRunner / apply_pipeline_parallel: a rank's stage on torch.distributed.pipelining,
                   one optimizer step's micro-batches through the schedule, gradients summed and clipped
                   across stages (what DistCATrainer runs with pipeline_parallel_size > 1)

Every name is loaded on first use: the trainer and the accelerator import transformers' and
accelerate's heavier modules, packing imports torch, and a script's ``--help`` needs none of them.
"""

from importlib import import_module

_LAZY = {
    **dict.fromkeys(("load_documents", "DocumentSourceError", "MissingDocumentsError"), "loading"),
    **dict.fromkeys(("GlobalBatchSampler", "PackedCollator", "PackedDataset", "PackedRow", "PackingConfig",
                     "PackingReport", "RankLayout", "StreamingPackedDataset", "pack_lengths", "pack_rows"), "packing"),
    **dict.fromkeys(("DistCAGroups", "DistCAPlugin", "ParallelSizes", "model_parallel_sizes", "read_distca_section"),
                    "plugin"),
    **dict.fromkeys(("ParallelTopology", "group_ranks"), "topology"),
    "DistCAArguments": "arguments",
    **dict.fromkeys(("DistCASFTTrainer", "SFTPackedCollator", "SFTPackedDataset"), "trl"),
    "DistCATrainer": "trainer", "StepTableCallback": "trainer", "DistCAAccelerator": "accelerator",
    "prepare_training_arguments": "accelerator", "require_distca_model": "accelerator", "apply_cpu_fsdp": "accelerator",
    "parallelism_config_for_cpu": "accelerator",
    "prepare_cpu_launch": "launch_checks",
    **dict.fromkeys(("PipelineStageModule", "build_stage_module", "check_layer_split", "gather_full_state_dict",
                     "load_stage_from_pretrained", "save_pipeline_model", "stage_io_shapes", "stage_layer_range",
                     "stage_parameter_names", "stage_state_dict", "sync_tied_embedding_grads",
                     "tied_embedding_parameter"), "pipeline_stages"),
    **dict.fromkeys(("PipelineRunner", "apply_pipeline_parallel", "pipeline_targets"), "pipeline"),
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        try:
            return getattr(import_module(f".{_LAZY[name]}", __name__), name)
        except AttributeError as e:  # (``from distca_hf.training import X`` would say only "cannot import name")
            raise ImportError(f"importing {name} from {__name__}.{_LAZY[name]} failed: {e!r}") from e
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *__all__})
