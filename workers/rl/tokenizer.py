"""Tokenizers: the model directory's own, or a small BPE trained on the objective's corpus.

A trained tokenizer splits digits individually (so numbers compose from ten symbols) and is
wrapped as a `PreTrainedTokenizerFast`, so it saves next to the checkpoint in HF format.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"


def train_bpe(corpus: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, EOS, UNK], show_progress=False
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK, padding_side="left"
    )


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer in {path} has no eos token")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok
