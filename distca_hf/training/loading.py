"""Loading documents: local files, ``save_to_disk`` folders, Hub names or ``datasets`` objects, as a
``datasets`` dataset of token ids (one ``input_ids`` column) ready for packing.

Errors are one line that says what is wrong and which argument to change, named as the caller's
users set it (``flags``: e.g. ``--text_column`` in the examples). A path that does not exist is
reported at once: the Hub is asked only for names shaped like a Hub dataset (``owner/name``).
"""

from __future__ import annotations

import re
from pathlib import Path

from ..config import INT32_MAX as MAX_COUNT, is_integer
from .packing import MASKING_COLUMNS, is_streaming, refuse_masks

__all__ = ["DocumentSourceError", "MissingDocumentsError", "load_documents", "looks_like_hub_name", "open_dataset",
           "tokenize"]

_EXTENSION_BUILDERS = {".json": "json", ".jsonl": "json", ".txt": "text", ".csv": "csv", ".parquet": "parquet"}
_HUB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


class DocumentSourceError(ValueError):
    """The documents cannot be read as asked (no such split or column, no documents, no tokenizer)."""


class MissingDocumentsError(DocumentSourceError, FileNotFoundError):
    """The documents' path does not exist (and it is not a Hub dataset name)."""


def _flag(flags: dict | None, name: str) -> str:
    """How the caller's users set the argument ``name``: ``flags[name]``, else ``name=``."""
    return (flags or {}).get(name, f"{name}=")


def looks_like_hub_name(source: str) -> bool:
    """Whether ``source`` is shaped like a Hub dataset name, ``owner/name``, and not like a file
    (a data-file suffix, a leading ``.``, ``/`` or ``~``)."""
    return (bool(_HUB_NAME.fullmatch(source)) and Path(source).suffix.lower() not in _EXTENSION_BUILDERS
            and not source.startswith((".", "~")))


def load_documents(source, tokenizer=None, *, split: str = "train", text_column: str = "text",
                   streaming: bool = False, add_eos: bool | None = None, eos_token_id: int | None = None,
                   flags: dict | None = None, **load_kwargs):
    """Token-id documents as a ``datasets`` dataset with a single ``input_ids`` column. Documents given
    as token ids whose ``labels``, ``attention_mask`` or ``position_ids`` say something packing would
    lose (a masked prompt, padding) are refused (``packing.refuse_masks``); a stream keeps those
    columns, and packing refuses such a row as it reads it.

    Args:
        source: a ``datasets.Dataset`` / ``IterableDataset``; a local file (``.json``, ``.jsonl``,
            ``.txt``, ``.csv``, ``.parquet``); a directory (``save_to_disk`` output, or data files);
            or a Hub dataset name ``owner/name`` (``load_dataset(source, split=split, **load_kwargs)``).
        tokenizer: a ``transformers`` tokenizer or a ``tokenizers.Tokenizer``; needed unless the data
            already has ``input_ids``.
        text_column: the text to tokenize.
        streaming: read lazily (an ``IterableDataset``; pack it with ``StreamingPackedDataset``).
        add_eos: append the end-of-sequence token to every document that does not end with it already
            (``None``: yes for text; a ``tokenizers.Tokenizer``'s post-processor adds nothing). Text only:
            documents given as token ids are kept as they are, and ``add_eos=True``, ``text_column`` or
            ``eos_token_id`` given with them is refused.
        eos_token_id: that token (default: the tokenizer's ``eos_token_id``).
        flags: how the caller's users set these arguments, for the errors: ``{"source": "--dataset",
            "text_column": "--text_column", "split": "--dataset_split", "tokenizer": "--model_name_or_path"}``
            (default: the argument names, ``text_column=``).

    Raises:
        MissingDocumentsError: ``source`` is a path that does not exist (and not an ``owner/name``).
        DocumentSourceError: no such split or column, no documents, no tokenizer for text.
    """
    _check_add_eos(add_eos)
    dataset = open_dataset(source, split=split, streaming=streaming, flags=flags, **load_kwargs)
    _require_documents(dataset, source, flags)
    columns = dataset.column_names
    if columns is not None and "input_ids" in columns:
        # (ignored before: the documents came back as they were, without the asked-for column or token)
        given = [f"{_flag(flags, 'text_column')} {text_column}" if text_column != "text" else None,
                 "add_eos=True" if add_eos is True else None,
                 f"eos_token_id={eos_token_id}" if eos_token_id is not None else None]
        given = [g for g in given if g]
        if given:
            raise DocumentSourceError(f"{' and '.join(given)}: the documents already hold token ids (an 'input_ids' "
                                      "column), which are kept as they are; these apply to text only: drop them")
        # masked labels, padding or positions of their own would be dropped with the other columns and their
        # tokens trained: refused now (a stream keeps those columns, whose rows packing checks as it reads)
        masking = [c for c in MASKING_COLUMNS if c in columns]
        if not is_streaming(dataset):
            named = source if isinstance(source, (str, Path)) else type(source).__name__
            refuse_masks(dataset, f"{_flag(flags, 'source')} {named}")
            masking = []
        return dataset.select_columns(["input_ids", *masking])
    return tokenize(dataset, tokenizer, text_column=text_column, add_eos=add_eos, eos_token_id=eos_token_id,
                    flags=flags)


def open_dataset(source, *, split: str = "train", streaming: bool = False, flags: dict | None = None, **load_kwargs):
    """``source`` (see ``load_documents``) as a ``datasets`` dataset, untouched."""
    import datasets

    if isinstance(source, (datasets.Dataset, datasets.IterableDataset)):
        _refuse_load_kwargs(load_kwargs, "a dataset in hand")
        _check_one_split(source, split, "the dataset given", flags)
        return source.to_iterable_dataset() if streaming and isinstance(source, datasets.Dataset) else source
    if isinstance(source, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        _refuse_load_kwargs(load_kwargs, "a dataset in hand")
        if split not in source:
            raise DocumentSourceError(f"{_flag(flags, 'split')} {split}: no such split in the dataset (splits: "
                                      f"{sorted(source)})")
        chosen = source[split]  # (streaming=True returned it map-style before)
        return chosen.to_iterable_dataset() if streaming and isinstance(chosen, datasets.Dataset) else chosen
    if not isinstance(source, (str, Path)):
        raise TypeError(f"source must be a datasets dataset, a path or a dataset name, got {type(source).__name__}")
    path = Path(source).expanduser()
    if not path.exists():
        if isinstance(source, str) and looks_like_hub_name(source):
            return datasets.load_dataset(source, split=split, streaming=streaming, **load_kwargs)
        raise MissingDocumentsError(
            f"{_flag(flags, 'source')} {source}: no such file or folder (a Hub dataset would be named owner/name)")
    if path.is_dir():
        if (path / "dataset_info.json").exists() or (path / "state.json").exists() or (path / "dataset_dict.json").exists():
            _refuse_load_kwargs(load_kwargs, f"a save_to_disk folder ({path})")
            dataset = datasets.load_from_disk(str(path))
            if isinstance(dataset, datasets.DatasetDict):
                if split not in dataset:
                    raise DocumentSourceError(f"{_flag(flags, 'split')} {split}: no such split in {path} "
                                              f"(splits: {sorted(dataset)})")
                dataset = dataset[split]
            else:
                _check_one_split(dataset, split, str(path), flags)
            return dataset.to_iterable_dataset() if streaming else dataset
        return datasets.load_dataset(str(path), split=split, streaming=streaming, **load_kwargs)
    builder = _EXTENSION_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise DocumentSourceError(f"{_flag(flags, 'source')} {path}: unknown file type {path.suffix!r}; expected one "
                                  f"of {sorted(_EXTENSION_BUILDERS)}, a save_to_disk folder or a Hub name")
    if _blank(path):
        raise DocumentSourceError(f"{_flag(flags, 'source')} {path} holds no documents (the file is empty)")
    if split != "train":  # one file is one split, "train": another was read as the whole file before
        raise DocumentSourceError(f"{_flag(flags, 'split')} {split}: a single file ({path.name}) holds one split, "
                                  "'train'; point the source at that split's own file instead")
    return datasets.load_dataset(builder, data_files=str(path), split="train", streaming=streaming, **load_kwargs)


def _check_one_split(dataset, split: str, where: str, flags) -> None:
    """One dataset (no splits) read as ``split``: refused when it cannot be that split, having no split
    name (``Dataset.from_dict``, a single saved dataset) while another than the default ``"train"`` is
    asked (that split was read as the whole set before), or when a slice is asked (it was ignored). A
    dataset that records a split (``load_dataset(..., split=)``; ``train_test_split`` keeps its parent's)
    is taken as the split asked."""
    own = getattr(dataset, "split", None)
    if "[" in split:
        raise DocumentSourceError(f"{_flag(flags, 'split')} {split}: {where} is a single dataset, which load_documents "
                                  "does not slice; slice it first (dataset.select(range(...)))")
    if own is None and split != "train":
        raise DocumentSourceError(f"{_flag(flags, 'split')} {split}: {where} is a single dataset (no splits); drop "
                                  f"{_flag(flags, 'split')} or point the source at that split's own data")


def _refuse_load_kwargs(load_kwargs: dict, what: str) -> None:
    """``load_dataset``'s own arguments given for a source it does not read (dropped before)."""
    if load_kwargs:
        raise TypeError(f"load_documents: {sorted(load_kwargs)} go to datasets.load_dataset (a Hub name, data files), "
                        f"which {what} does not go through; drop them")


def _blank(path: Path) -> bool:
    """Whether the file holds nothing but whitespace (read until its first other byte)."""
    with path.open("rb") as file:
        while chunk := file.read(1 << 16):
            if chunk.strip():
                return False
    return True


def _require_documents(dataset, source, flags) -> None:
    """Raise ``DocumentSourceError`` when a (non-streaming) ``dataset`` has no rows."""
    try:
        rows = len(dataset)
    except TypeError:  # a stream: its length is unknown until read
        return
    if rows == 0:
        where = f"{_flag(flags, 'source')} {source}" if isinstance(source, (str, Path)) else "the dataset"
        raise DocumentSourceError(f"{where} holds no documents")


def _check_add_eos(add_eos) -> None:
    if add_eos is not None and not isinstance(add_eos, bool):
        raise TypeError(f"add_eos must be True, False or None (True for text), got {add_eos!r}")


def tokenize(dataset, tokenizer, *, text_column: str = "text", add_eos: bool | None = None,
             eos_token_id: int | None = None, flags: dict | None = None):
    """``dataset``'s ``text_column`` as token ids (one ``input_ids`` column), with an end-of-sequence
    token appended when ``add_eos`` (``None``: True). ``flags``: as for ``load_documents``."""
    columns = dataset.column_names
    if columns is not None and text_column not in columns:
        raise DocumentSourceError(f"{_flag(flags, 'text_column')} {text_column}: no such column in the documents "
                                  f"(columns: {columns})")
    if tokenizer is None:
        raise DocumentSourceError(f"the documents are text (column {text_column!r}) and no tokenizer was given; set "
                                  f"{_flag(flags, 'tokenizer')}")
    if not (hasattr(tokenizer, "encode_batch") or callable(tokenizer)):  # a model name: a str is not callable
        raise TypeError(f"tokenizer must be a transformers tokenizer (AutoTokenizer.from_pretrained(name)) or a "
                        f"tokenizers.Tokenizer, got {type(tokenizer).__name__} {tokenizer!r}")
    _check_add_eos(add_eos)
    add_eos = add_eos is not False
    if add_eos and eos_token_id is None:
        eos_token_id = getattr(tokenizer, "eos_token_id", None)
        if eos_token_id is None:
            raise DocumentSourceError("add_eos=True but the tokenizer has no eos_token_id; pass eos_token_id= or "
                                      "add_eos=False")
    if not add_eos and eos_token_id is not None:  # (ignored before)
        raise ValueError(f"eos_token_id={eos_token_id!r} is appended only with add_eos=True; drop one of them")
    if add_eos and not (is_integer(eos_token_id) and 0 <= eos_token_id <= MAX_COUNT):
        raise ValueError(f"eos_token_id must be a token id (an integer from 0 to {MAX_COUNT}), got {eos_token_id!r}")
    encode = _batch_encoder(tokenizer)
    suffix = [int(eos_token_id)] if add_eos else []

    def encode_batch(batch):
        texts = batch[text_column]
        for text in texts:
            if not isinstance(text, str):  # the tokenizer's own error named neither the row nor the column
                raise DocumentSourceError(f"{_flag(flags, 'text_column')} {text_column}: every document must be text, "
                                          f"got {type(text).__name__} {text!r}")
        # a text that already ends with the token keeps one (as TRL's add_eos)
        return {"input_ids": [ids + suffix if ids[-1:] != suffix else ids for ids in encode(texts)]}

    return dataset.map(encode_batch, batched=True, remove_columns=columns)


def _batch_encoder(tokenizer):
    if hasattr(tokenizer, "encode_batch"):  # tokenizers.Tokenizer: no post-processor's tokens, as transformers' below
        return lambda texts: [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    return lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"]
