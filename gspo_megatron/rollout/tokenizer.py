"""A tiny, deterministic character-level tokenizer built locally (no hub download).

It covers what the synthetic tasks (and short English instructions) need: digits, ASCII letters,
space, newline and common punctuation, plus Qwen-style special tokens:

    id 0 ``<|endoftext|>``  pad (as in Qwen)
    id 1 ``<|im_start|>``   start of a chat turn
    id 2 ``<|im_end|>``     end of a chat turn == eos
    id 3 ``<|unk|>``        any character outside the alphabet

then one id per character of ``ALPHABET`` in order (ids are a pure function of this file).
The chat template is Qwen's ChatML shape, so prompts look like a real Qwen3 conversation:

    <|im_start|>user\\n12+34=<|im_end|>\\n<|im_start|>assistant\\n

and a completion ends with ``<|im_end|>`` (the eos token).
"""
from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END, UNK_TOKEN)

ALPHABET = (
    "\n "
    + string.digits
    + string.ascii_lowercase
    + string.ascii_uppercase
    + "+-*/=<>()[]{}.,:;!?'\"_^#%&|~$\\"
)

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


def _vocab() -> dict[str, int]:
    tokens = list(SPECIAL_TOKENS) + list(ALPHABET)
    assert len(set(tokens)) == len(tokens), "duplicate character in ALPHABET"
    return {tok: i for i, tok in enumerate(tokens)}


def build_tokenizer(save_dir: str | None = None) -> PreTrainedTokenizerFast:
    """Build the character-level tokenizer; with `save_dir`, also `save_pretrained` it there.

    Vocabulary size is ``len(SPECIAL_TOKENS) + len(ALPHABET)`` (< 128). No BOS is added by
    `encode`; `decode(..., skip_special_tokens=True)` drops the special tokens.
    """
    vocab = _vocab()
    assert len(vocab) < 128
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # every character is its own pre-token ([\s\S] so that newlines are matched too)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # concatenate characters back without separators
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[IM_START],
        padding_side="left",
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    # the special tokens were in the base vocab: adding them must not have created new ids
    for t in SPECIAL_TOKENS:
        assert fast.convert_tokens_to_ids(t) == vocab[t], t
    assert len(fast) == len(vocab)
    if save_dir is not None:
        fast.save_pretrained(save_dir)
    return fast
