"""Loading documents: local files, ``save_to_disk`` folders, Hub names or ``datasets`` objects, as a
``datasets`` dataset of token ids (one ``input_ids`` column) ready for packing.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["load_documents", "open_dataset", "tokenize"]

_EXTENSION_BUILDERS = {".json": "json", ".jsonl": "json", ".txt": "text", ".csv": "csv", ".parquet": "parquet"}


def load_documents(source, tokenizer=None, *, split: str = "train", text_column: str = "text",
                   streaming: bool = False, add_eos: bool = True, eos_token_id: int | None = None,
                   **load_kwargs):
    """Token-id documents as a ``datasets`` dataset with a single ``input_ids`` column.

    Args:
        source: a ``datasets.Dataset`` / ``IterableDataset``; a local file (``.json``, ``.jsonl``,
            ``.txt``, ``.csv``, ``.parquet``); a directory (``save_to_disk`` output, or data files);
            or a Hub dataset name (``load_dataset(source, split=split, **load_kwargs)``).
        tokenizer: a ``transformers`` tokenizer or a ``tokenizers.Tokenizer``; needed unless the data
            already has ``input_ids``.
        text_column: the text to tokenize.
        streaming: read lazily (an ``IterableDataset``; pack it with ``StreamingPackedDataset``).
        add_eos: append the end-of-sequence token to every document.
        eos_token_id: that token (default: the tokenizer's ``eos_token_id``).
    """
    dataset = open_dataset(source, split=split, streaming=streaming, **load_kwargs)
    columns = dataset.column_names
    if columns is not None and "input_ids" in columns:
        return dataset.select_columns(["input_ids"])
    return tokenize(dataset, tokenizer, text_column=text_column, add_eos=add_eos, eos_token_id=eos_token_id)


def open_dataset(source, *, split: str = "train", streaming: bool = False, **load_kwargs):
    """``source`` (see ``load_documents``) as a ``datasets`` dataset, untouched."""
    import datasets

    if isinstance(source, (datasets.Dataset, datasets.IterableDataset)):
        return source
    if isinstance(source, (str, Path)) and Path(source).exists():
        path = Path(source)
        if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "state.json").exists()):
            dataset = datasets.load_from_disk(str(path))
            if isinstance(dataset, datasets.DatasetDict):
                dataset = dataset[split]
            return dataset.to_iterable_dataset() if streaming else dataset
        if path.is_dir():
            return datasets.load_dataset(str(path), split=split, streaming=streaming, **load_kwargs)
        builder = _EXTENSION_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ValueError(f"{path}: unknown file type {path.suffix!r}; expected one of {sorted(_EXTENSION_BUILDERS)}")
        return datasets.load_dataset(builder, data_files=str(path), split="train", streaming=streaming, **load_kwargs)
    if isinstance(source, str):
        return datasets.load_dataset(source, split=split, streaming=streaming, **load_kwargs)
    raise TypeError(f"source must be a datasets dataset, a path or a dataset name, got {type(source).__name__}")


def tokenize(dataset, tokenizer, *, text_column: str = "text", add_eos: bool = True, eos_token_id: int | None = None):
    """``dataset``'s ``text_column`` as token ids (one ``input_ids`` column), with an end-of-sequence
    token appended when ``add_eos``."""
    columns = dataset.column_names
    if tokenizer is None:
        raise ValueError(f"the documents have no 'input_ids' column (columns: {columns}); pass tokenizer= to "
                         f"tokenize their {text_column!r} column")
    if columns is not None and text_column not in columns:
        raise ValueError(f"no text column {text_column!r} in the documents (columns: {columns}); pass text_column=")
    if add_eos and eos_token_id is None:
        eos_token_id = getattr(tokenizer, "eos_token_id", None)
        if eos_token_id is None:
            raise ValueError("add_eos=True but the tokenizer has no eos_token_id; pass eos_token_id= or add_eos=False")
    encode = _batch_encoder(tokenizer)
    suffix = [eos_token_id] if add_eos else []

    def encode_batch(batch):
        return {"input_ids": [ids + suffix for ids in encode(batch[text_column])]}

    return dataset.map(encode_batch, batched=True, remove_columns=columns)


def _batch_encoder(tokenizer):
    if hasattr(tokenizer, "encode_batch"):  # tokenizers.Tokenizer
        return lambda texts: [e.ids for e in tokenizer.encode_batch(texts)]
    return lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"]
