"""Word-level instruction tokenizer, built offline from the instructions an env can give.

Language-conditioned task suites use a small closed set of instructions, so a word-level
vocabulary over those instructions is enough (and needs no download): text is lowercased,
split on whitespace and punctuation, and every word seen while building gets an id. Words
never seen map to ``[UNK]``. Ids ``[PAD]`` = 0, ``[UNK]`` = 1, ``[BOS]`` = 2 come first;
every encoded instruction starts with ``[BOS]``, so an empty instruction (or an env without
instructions) still gives one real token to attend to.

The tokenizer is a Hugging Face ``tokenizers`` object (normalizer, pre-tokenizer, word-level
model), saved as the library's own ``tokenizer.json``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from mmrl.errors import MissingExtraError

PAD, UNK, BOS = "[PAD]", "[UNK]", "[BOS]"
SPECIAL_TOKENS = (PAD, UNK, BOS)
FILE_NAME = "tokenizer.json"


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise MissingExtraError("tokenizers", "vla", "the VLA instruction tokenizer") from None
    return tokenizers


class InstructionTokenizer:
    """Lowercased word-level tokenizer: ``[BOS] w_1 … w_n [PAD] …`` padded to a fixed length."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        for i, token in enumerate(SPECIAL_TOKENS):
            if tokenizer.token_to_id(token) != i:
                raise ValueError(f"tokenizer must map {token} to id {i}, got {tokenizer.token_to_id(token)}")
        self.pad_id, self.unk_id, self.bos_id = range(len(SPECIAL_TOKENS))

    @classmethod
    def build(cls, instructions: list[str]) -> "InstructionTokenizer":
        """Vocabulary = the special tokens, then every word of ``instructions`` (most
        frequent first, ties alphabetical — the same list in any order gives the same ids)."""
        tk = _tokenizers()
        from tokenizers import models, normalizers, pre_tokenizers, trainers

        tokenizer = tk.Tokenizer(models.WordLevel(unk_token=UNK))
        tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
        trainer = trainers.WordLevelTrainer(vocab_size=1 << 30, min_frequency=0, special_tokens=list(SPECIAL_TOKENS), show_progress=False)
        tokenizer.train_from_iterator([str(text) for text in instructions], trainer=trainer)
        return cls(tokenizer)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def tokens(self, text: str) -> list[str]:
        """The words of ``text`` as the vocabulary sees them (before id lookup)."""
        normalized = self.tokenizer.normalizer.normalize_str(text)
        return [word for word, _ in self.tokenizer.pre_tokenizer.pre_tokenize_str(normalized)]

    def encode(self, texts: list[str], max_length: int) -> tuple[Tensor, Tensor]:
        """Ids [N, max_length] (``[BOS]`` first, truncated, right-padded with ``[PAD]``)
        and the float mask [N, max_length] (1 = real token)."""
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        encodings = self.tokenizer.encode_batch([str(text) for text in texts], add_special_tokens=False)
        # padded on the host and made a tensor at once: one operator for the batch, not one per row
        rows = [[self.bos_id, *encoding.ids][:max_length] for encoding in encodings]
        ids = torch.tensor([row + [self.pad_id] * (max_length - len(row)) for row in rows], dtype=torch.long).view(len(rows), max_length)
        return ids, (ids != self.pad_id).float()

    def save(self, directory) -> None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(path / FILE_NAME))

    @classmethod
    def load(cls, directory) -> "InstructionTokenizer":
        tk = _tokenizers()
        path = Path(directory) / FILE_NAME
        if not path.is_file():
            raise FileNotFoundError(f"no {FILE_NAME} in {directory} (written by InstructionTokenizer.save)")
        return cls(tk.Tokenizer.from_file(str(path)))

    def to_json(self) -> str:
        return self.tokenizer.to_str()
