"""Tokenizers of the embedded backends, built from a :class:`TokenizerConfig`.

Three sources, exactly one per config:

* ``path``: a local Hugging Face tokenizer directory (``local_files_only``; nothing
  is downloaded). A tokenizer without a pad token pads with its eos token.
* ``chars``: a character-level tokenizer: one token per character of the alphabet
  (spaces and newlines included), built with the ``tokenizers`` library as a
  WordLevel model behind a pre-tokenizer that isolates every character.
* ``byte_level``: 256 byte tokens (GPT-2's byte-to-unicode alphabet, BPE with no
  merges), so any UTF-8 text round-trips.

Built tokenizers share the special tokens ``<pad>`` (id 0), ``<bos>``, ``<eos>``
and ``<unk>`` (ids 1-3). Left out on purpose: no post-processor, so encoding adds
no special tokens (prompt builders add ``<bos>`` themselves if they want it). A
byte-level tokenizer takes ``chat_template`` (``chatml``: :data:`CHATML_TEMPLATE`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from rlpipe.errors import ConfigError
from rlpipe.schemas.config import TokenizerConfig

if TYPE_CHECKING:  # transformers costs a second to import: a process that never builds a tokenizer skips it
    from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)

CHATML_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
"""ChatML, the message layout of Qwen2.5's instruct models (without their default system message)."""


def build_tokenizer(cfg: TokenizerConfig) -> PreTrainedTokenizerFast:
    """The tokenizer ``cfg`` describes, with ``pad_token`` and ``eos_token`` set."""
    if cfg.path is not None:
        return _load_local(cfg.path)
    if cfg.chars is not None:
        return _wrap(_char_level(cfg.chars))
    tokenizer = _wrap(_byte_level())
    if cfg.chat_template is not None:
        tokenizer.chat_template = CHATML_TEMPLATE if cfg.chat_template == "chatml" else cfg.chat_template
    return tokenizer


def _special_vocab() -> dict[str, int]:
    return {token: i for i, token in enumerate(SPECIAL_TOKENS)}


def _char_level(chars: str) -> Tokenizer:
    vocab = _special_vocab()
    for ch in chars:  # first occurrence wins, so duplicates in the config are harmless
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # `[\s\S]` (not `.`) so newlines are characters like any other.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse joins the characters back without the spaces WordLevel would insert.
    tok.decoder = decoders.Fuse()
    return tok


def _byte_level() -> Tokenizer:
    vocab = _special_vocab()
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    # BPE without merges = one token per byte; the ByteLevel pieces map bytes to
    # printable symbols and back.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK
    )


def _load_local(path: str) -> PreTrainedTokenizerFast:
    if not Path(path).is_dir():
        raise ConfigError(
            f"tokenizer.path {path!r} is not a directory on this node; point it at a local Hugging Face "
            "tokenizer folder (nothing is downloaded) or use `chars` / `byte_level: true`. On a Ray cluster whose "
            "nodes do not all have that folder, set resources.shared_filesystem: false (the driver ships it)"
        )
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load the tokenizer in {path!r}: {exc}") from exc
    if not isinstance(tok, PreTrainedTokenizerFast):
        raise ConfigError(
            f"the tokenizer in {path!r} is a slow ({type(tok).__name__}) tokenizer; "
            "save a fast one (tokenizer.json) into that folder"
        )
    if tok.eos_token is None:
        raise ConfigError(f"the tokenizer in {path!r} has no eos_token; set one in its tokenizer_config.json")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token  # pad positions are masked out, so reusing eos is safe
    return tok
