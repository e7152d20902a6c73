"""Tokenizers built from config: round trips, specials, save and reload."""

import pytest

from rlpipe.backends.tokenizer import build_tokenizer
from rlpipe.errors import ConfigError
from rlpipe.schemas.config import TokenizerConfig

ALPHABET = "abc 0123456789+=\n"


def test_char_level_round_trips_with_spaces_and_newlines():
    tok = build_tokenizer(TokenizerConfig(chars=ALPHABET))
    text = "12 + 3 =\n  15"
    ids = tok.encode(text)
    assert len(ids) == len(text)  # one token per character, no specials added
    assert tok.decode(ids) == text
    assert [tok.pad_token, tok.bos_token, tok.eos_token, tok.unk_token] == ["<pad>", "<bos>", "<eos>", "<unk>"]
    assert tok.pad_token_id == 0
    assert len(tok) == 4 + len(set(ALPHABET))


def test_char_level_unknown_chars_and_skip_special_tokens():
    tok = build_tokenizer(TokenizerConfig(chars=ALPHABET))
    assert tok.encode("a?") == [tok.convert_tokens_to_ids("a"), tok.unk_token_id]
    ids = [tok.bos_token_id] + tok.encode("a b") + [tok.eos_token_id, tok.pad_token_id]
    assert tok.decode(ids, skip_special_tokens=True) == "a b"


def test_byte_level_round_trips_any_utf8():
    tok = build_tokenizer(TokenizerConfig(byte_level=True))
    text = "héllo wörld\n\t✓ 12"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert len(tok) == 256 + 4
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == text


@pytest.mark.parametrize("cfg", [TokenizerConfig(chars=ALPHABET), TokenizerConfig(byte_level=True)])
def test_save_and_reload_from_a_local_directory(tmp_path, cfg):
    tok = build_tokenizer(cfg)
    tok.save_pretrained(tmp_path)
    again = build_tokenizer(TokenizerConfig(path=str(tmp_path)))
    text = "a1 + 2\n"
    assert again.encode(text) == tok.encode(text)
    assert again.decode(again.encode(text)) == text
    assert (again.pad_token_id, again.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)


def test_missing_directory_says_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match="not a directory.*nothing is downloaded"):
        build_tokenizer(TokenizerConfig(path=str(tmp_path / "nope")))


def test_a_byte_level_tokenizer_renders_chatml_and_keeps_it_when_saved(tmp_path):
    from rlpipe.agents.chat import render

    tok = build_tokenizer(TokenizerConfig(byte_level=True, chat_template="chatml"))
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    text = render(tok, convo)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text  # bytes: every marker round-trips
    tok.save_pretrained(tmp_path)  # what a run saves with its model, and a CPU twin's vLLM server loads
    assert render(build_tokenizer(TokenizerConfig(path=str(tmp_path))), convo) == text


def test_a_chat_template_needs_the_byte_level_tokenizer():
    with pytest.raises(ValueError, match="tokenizer.chat_template is for `byte_level: true`"):
        TokenizerConfig(chars="abc", chat_template="chatml")
