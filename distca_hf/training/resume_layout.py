"""What a checkpoint's run read, so that a resume under another layout is refused instead of mis-read.

The Trainer resumes mid-epoch by skipping as many batches as the checkpoint's steps trained
(``global_step x gradient_accumulation_steps`` micro-batches, each rank its share). That lands where
the checkpoint stood only if the rows are the same rows in the same order: the same packed dataset
(its documents, ``PackingConfig``), laid out for the same ranks (processes, ``span_ranks``, server
groups) and read with the same accumulation, batch size and sampler seed. Under another layout the
skipped batches are others' and some documents train twice in that epoch while others not at all,
without a word (measured: 2 -> 1 processes, 70 tokens of 518 left out and 166 trained twice; the plain
Trainer behaves alike, naming none of it).

``reading_layout(trainer)`` is that record (JSON-ready); the trainers write it into every checkpoint
(``LAYOUT_FILE``) and ``check_resume_layout`` compares it when ``train(resume_from_checkpoint=...)``
starts, naming every field that changed. A checkpoint without the file (saved by an earlier release)
resumes as before.
"""

from __future__ import annotations

import dataclasses
import json
import os

__all__ = ["LAYOUT_FILE", "check_resume_layout", "reading_layout", "save_reading_layout"]

LAYOUT_FILE = "distca_data_layout.json"


def reading_layout(trainer) -> dict:
    """What ``trainer``'s training run reads and how: a JSON-ready ``{field: value}`` (``None`` where the
    dataset does not say: a streaming dataset has no length)."""
    args, dataset = trainer.args, trainer.train_dataset
    layout = getattr(dataset, "layout", None)
    config = getattr(dataset, "config", None)
    report = getattr(dataset, "report", None)
    try:
        rows = len(dataset)
    except TypeError:
        rows = None
    groups = getattr(layout, "server_groups", None)
    record = {
        "processes": args.world_size,
        "span_ranks": getattr(layout, "span_ranks", None),
        "server_groups": [list(group) for group in groups] if groups is not None else None,
        "packing": dataclasses.asdict(config) if dataclasses.is_dataclass(config) else None,
        "documents": getattr(report, "documents", None),
        "document_tokens": getattr(report, "tokens", None),
        "rows": rows,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "data_seed": args.data_seed if args.data_seed is not None else args.seed,
    }
    return json.loads(json.dumps(record, default=str))  # as the file holds it (tuples as lists)


def save_reading_layout(checkpoint_dir: str, layout: dict) -> None:
    """Write ``layout`` into ``checkpoint_dir`` (the main process; the folder exists)."""
    with open(os.path.join(checkpoint_dir, LAYOUT_FILE), "w") as f:
        json.dump(layout, f, indent=1, sort_keys=True)


def check_resume_layout(checkpoint_dir: str, layout: dict) -> None:
    """Raise ``ValueError`` naming every field in which ``layout`` (this run's) differs from what the
    checkpoint's run read; nothing when the checkpoint holds no record."""
    path = os.path.join(checkpoint_dir, LAYOUT_FILE)
    if not os.path.isfile(path):
        return
    with open(path) as f:
        saved = json.load(f)
    changed = [f"{name}: {saved.get(name)!r} then, {layout.get(name)!r} now"
               for name in sorted(set(saved) | set(layout)) if saved.get(name) != layout.get(name)]
    if changed:
        raise ValueError(
            f"resuming {checkpoint_dir}: this run reads its training data otherwise than the checkpoint's did ("
            + "; ".join(changed) + "). The Trainer resumes by skipping the batches the checkpoint's steps trained, so "
            "some documents would train twice this epoch and others not at all. Resume with the checkpoint's "
            "settings, or start a new run from its weights (model=from_pretrained of the checkpoint folder, a new "
            "output_dir)")
