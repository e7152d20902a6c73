"""A real BPE tokenizer with a Qwen-style chat template, trained locally (no downloads) for the tests.

Byte-level BPE (GPT-2/Qwen's alphabet, merges learned from ``corpus``), the special tokens
``<|endoftext|>`` (pad), ``<|im_start|>`` and ``<|im_end|>`` (eos), and a chat template in the
shape of Qwen2.5's: a default system message, ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per
message, ``<|im_start|>assistant\\n`` as the generation prompt. Saved with ``save_pretrained``, so a
pipeline reads it as any Hugging Face tokenizer folder (``tokenizer.path``).

Unlike rlpipe's char- and byte-level tokenizers its merges make the token ids of a text depend on
its neighbours: tokenizing a conversation as a whole differs from tokenizing its turns one by one,
which is what the agent gateway's "no re-tokenization" record has to get right.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SYSTEM = "You are a helpful assistant."

CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\n" + SYSTEM + "<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def train_bpe_tokenizer(folder: str | Path, corpus: Iterable[str], vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """Train on ``corpus`` (plus the template's own text), save to ``folder``, return the HF tokenizer."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts = [*corpus, f"system\n{SYSTEM}\n", "user\n", "assistant\n", "tool\n"]
    tok.train_from_iterator(texts * 4, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=PAD)
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(folder))
    return hf
