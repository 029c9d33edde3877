"""The tokenizers of the tiny models of every family, built in-process (nothing downloaded):
a byte-level one for text models, VLMs and text encoders, a word-level one for closed
vocabularies.

The byte-level tokenizer: every UTF-8 byte is one token (256 ids, in the order of the
``tokenizers`` byte-level alphabet), so any text encodes and decodes losslessly. Three
special tokens follow, named as in Qwen2 chat models so that prompts and chat templates
look like a real model's:
``<|endoftext|>`` (padding), ``<|im_start|>`` (start of a chat turn) and ``<|im_end|>``
(end of a turn, the EOS). The chat template is ChatML.
"""

from __future__ import annotations

from mmrl.errors import MissingExtraError

PAD, TURN_START, TURN_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer(extra_special_tokens: tuple[str, ...] = ()):
    """A ``transformers`` fast tokenizer: 256 byte tokens + the three special tokens (and
    ``extra_special_tokens`` after them, e.g. an image placeholder), EOS ``<|im_end|>``,
    padding ``<|endoftext|>`` on the left, the ChatML chat template."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        raise MissingExtraError("transformers", "text", "the text policy's byte-level tokenizer") from None

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    # a BPE model without merges: every byte stays its own token
    tokenizer = Tokenizer(models.BPE(vocab={symbol: i for i, symbol in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD,
        eos_token=TURN_END,
        additional_special_tokens=[TURN_START, *extra_special_tokens],
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
    )


def word_tokenizer(words: list[str] | tuple[str, ...]):
    """A ``transformers`` fast tokenizer whose tokens are whole words: ``<pad>`` (0),
    ``<eos>`` (1), ``<unk>`` (2), then ``words`` in order. Text is lower-cased and split on
    whitespace and punctuation; a word outside the list becomes ``<unk>``. The small closed
    vocabularies of synthetic prompt worlds (the shapes world's colours, shapes and counts)
    get one token per word, as a real CLIP BPE vocabulary has for common words, instead of
    the byte-level tokenizer's one token per letter."""
    try:
        from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        raise MissingExtraError("transformers", "text", "the word-level tokenizer") from None

    specials = ["<pad>", "<eos>", "<unk>"]
    vocab = {token: i for i, token in enumerate([*specials, *(w.lower() for w in words)])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
