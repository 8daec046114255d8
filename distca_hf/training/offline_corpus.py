"""The demo's offline documents: Python's help topics and a byte-level BPE trained on them.

``examples/finetune_long_context.py`` trains on these when no ``--dataset`` is given, and
``distca-hf bench --workload demo`` packs the same documents, so both read them from here.
"""

from __future__ import annotations

__all__ = ["pydoc_topics", "offline_tokenizer", "OFFLINE_VOCAB_SIZE"]

OFFLINE_VOCAB_SIZE = 1024
"""Tokens in the offline BPE's vocabulary (its end-of-sequence token included)."""


def pydoc_topics() -> list[str]:
    """The texts of the standard library's help topics (``pydoc_data.topics``), in key order."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def offline_tokenizer(texts: list[str]):
    """A byte-level BPE of ``OFFLINE_VOCAB_SIZE`` tokens trained on ``texts``, as a
    ``PreTrainedTokenizerFast`` whose end-of-sequence and padding token is ``<eos>``.
    Deterministic: every rank trains the same one.

    Raises:
        ImportError: the ``tokenizers`` package is not installed (named in the message).
    """
    try:
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    except ImportError:
        raise ImportError("the offline tokenizer (a byte-level BPE trained on the pydoc topics) needs the "
                          "'tokenizers' package: pip install tokenizers") from None
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=OFFLINE_VOCAB_SIZE, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<eos>")
