"""A real tokenizer for tests, built offline in-process: a small byte-level BPE plus a chat template.

``chat_tokenizer()`` trains a byte-level BPE (``tokenizers``) on a few
sentences, wraps it in ``transformers.PreTrainedTokenizerFast`` with special
tokens ``<pad>`` (0), ``<eos>`` (1), ``<|user|>`` (2), ``<|assistant|>`` (3),
and sets a chat template whose assistant replies sit in ``{% generation %}``
blocks, so ``apply_chat_template(..., return_dict=True,
return_assistant_tokens_mask=True)`` returns ``assistant_masks`` as TRL's
``assistant_only_loss`` uses them. Building it takes ~50 ms; the result is
cached per process.
"""

from __future__ import annotations

import functools

__all__ = ["CHAT_TEMPLATE", "CORPUS", "SPECIAL_TOKENS", "chat_tokenizer", "conversations"]

SPECIAL_TOKENS = ("<pad>", "<eos>", "<|user|>", "<|assistant|>")

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "how many legs does a spider have? a spider has eight legs.",
    "what is the capital of france? the capital of france is paris.",
    "please add two and three. two plus three is five.",
    "context parallel training splits each sequence across ranks",
    "hello there, how can i help you today?",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|user|>{{ message['content'] }}"
    "{% else %}<|assistant|>{% generation %}{{ message['content'] }}<eos>{% endgeneration %}"
    "{% endif %}"
    "{% endfor %}"
)
"""User turns are prompts; each assistant reply and its ``<eos>`` are the trained completion."""


@functools.lru_cache(maxsize=1)
def chat_tokenizer():
    """A ``PreTrainedTokenizerFast`` (vocab ~300) with :data:`CHAT_TEMPLATE`; pad id 0, eos id 1."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=list(SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(CORPUS, trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token="<pad>", eos_token="<eos>",
        additional_special_tokens=["<|user|>", "<|assistant|>"],
    )  # fmt: skip
    tok.chat_template = CHAT_TEMPLATE
    return tok


def conversations() -> list[list[dict[str, str]]]:
    """Three short chats (one with two assistant turns)."""
    return [
        [{"role": "user", "content": "how many legs does a spider have?"},
         {"role": "assistant", "content": "a spider has eight legs."}],
        [{"role": "user", "content": "what is the capital of france?"},
         {"role": "assistant", "content": "paris."},
         {"role": "user", "content": "please add two and three."},
         {"role": "assistant", "content": "five."}],
        [{"role": "user", "content": "hello there"},
         {"role": "assistant", "content": "how can i help you today?"}],
    ]  # fmt: skip
