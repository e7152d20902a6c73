"""verl's and TRL's dataset formats load as they are: chat prompts, nested answers, extra_info, HF folders."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlpipe.agents.chat import render
from rlpipe.backends.tokenizer import build_tokenizer
from rlpipe.engine.planning.config_io import validate_config
from rlpipe.engine.planning.plan import build_plan
from rlpipe.engine.state.data import PromptLoader
from rlpipe.errors import ConfigError
from rlpipe.schemas.config import DataConfig, TokenizerConfig
from rlpipe.stages.datasets import DatasetError, load_dataset
from conftest import quickstart_raw

SYSTEM = {"role": "system", "content": "Answer with a number."}


def verl_rows(n=4):
    """Rows as verl's GSM8K preprocessing writes them (examples/data_preprocess/gsm8k.py)."""
    return [{"data_source": "openai/gsm8k",
             "prompt": [SYSTEM, {"role": "user", "content": f"What is {i} + {i}?"}],
             "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"split": "train", "index": i}} for i in range(n)]


def trl_rows(n=4):
    """TRL's conversational prompt-only format, the answer in a column of its own."""
    return [{"prompt": [{"role": "user", "content": f"{i}*3?"}], "solution": 3 * i, "level": "easy"}
            for i in range(n)]


def test_a_verl_parquet_keeps_its_chat_prompt_nested_answer_and_extra_info(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows()), path)
    table = load_dataset("parquet", {"path": str(path), "answer_key": "reward_model.ground_truth"}, 0)
    row = table.to_pylist()[1]
    assert row["prompt"] == "What is 1 + 1?"  # the last user message, for people to read
    assert json.loads(row["prompt_messages"]) == verl_rows()[1]["prompt"]  # never the JSON text as the prompt
    assert row["ground_truth"] == "2" and row["data_source"] == "openai/gsm8k"
    assert json.loads(row["extra_info"]) == {"split": "train", "index": 1}
    with pytest.raises(DatasetError, match=r"train\.parquet row 1: no field 'ground_truth'.*verl's format: set "
                                           r"data.params.answer_key: reward_model.ground_truth"):
        load_dataset("parquet", {"path": str(path)}, 0)


def test_trl_conversational_rows_pass_their_columns_as_extra_info(tmp_path):
    path = tmp_path / "trl.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in trl_rows()))
    params = {"path": str(path), "answer_key": "solution", "data_source": "mine",
              "prompt_template": "{prompt} Think first."}
    row = load_dataset("jsonl", params, 0).to_pylist()[2]
    messages = [{"role": "user", "content": "2*3? Think first."}]  # the template goes on the last user message
    assert row["prompt"] == "2*3? Think first." and json.loads(row["prompt_messages"]) == messages
    assert row["ground_truth"] == "6"
    assert json.loads(row["extra_info"]) == {"solution": 6, "level": "easy", "prompt": messages}


def test_an_hf_dataset_saved_to_disk_loads_like_the_parquet(tmp_path):
    datasets = pytest.importorskip("datasets")
    params = {"answer_key": "reward_model.ground_truth"}
    pq.write_table(pa.Table.from_pylist(verl_rows()), tmp_path / "train.parquet")
    want = load_dataset("parquet", {"path": str(tmp_path / "train.parquet"), **params}, 0)
    datasets.Dataset.from_list(verl_rows()).save_to_disk(str(tmp_path / "one"))
    assert load_dataset("hf", {"path": str(tmp_path / "one"), **params}, 0).equals(want)
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(verl_rows()),
                                   "test": datasets.Dataset.from_list(verl_rows(2))})
    splits.save_to_disk(str(tmp_path / "dict"))
    assert load_dataset("hf", {"path": str(tmp_path / "dict"), "split": "test", **params}, 0).num_rows == 2
    with pytest.raises(DatasetError, match=r"has splits \['test', 'train'\], not 'validation'; set data.params.split"):
        load_dataset("hf", {"path": str(tmp_path / "dict"), "split": "validation", **params}, 0)
    with pytest.raises(DatasetError, match="does not exist.*nothing is downloaded"):
        load_dataset("hf", {"path": str(tmp_path / "openai/gsm8k")}, 0)


def test_a_prompt_that_is_neither_text_nor_messages_names_its_row(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok", "ground_truth": "1", "data_source": "x"}\n'
                    '{"prompt": 17, "ground_truth": "1", "data_source": "x"}\n')
    with pytest.raises(DatasetError, match=r"bad\.jsonl:2: field 'prompt' is int '17'; a prompt is text or a list "
                                           r"of chat messages"):
        load_dataset("jsonl", {"path": str(path)}, 0)


def test_the_loader_renders_chat_prompts_with_the_chat_template_and_refuses_them_without(tmp_path):
    path = tmp_path / "trl.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in trl_rows()))
    tok = build_tokenizer(TokenizerConfig(byte_level=True))
    params = {"path": str(path), "answer_key": "solution", "data_source": "mine"}
    data = DataConfig(source="jsonl", params=params, prompts_per_step=2, shuffle=False, apply_chat_template=True)
    loader = PromptLoader(data, tok, seed=0)
    for i in range(4):  # the messages rendered (rlpipe's default template: the tokenizer has none), not their JSON
        want = tok(render(tok, trl_rows()[i]["prompt"]), add_special_tokens=False)["input_ids"]
        assert loader.prompt_ids[i].as_py() == want
    assert json.loads(loader.next_batch(0).column("extra_info")[0].as_py())["solution"] == 0
    with pytest.raises(ConfigError, match=r"prompt of row 1 .* is a list of chat messages; set data.apply_chat_template"):
        PromptLoader(data.model_copy(update={"apply_chat_template": False}), tok, seed=0)


def _plan(**changes):
    return build_plan(validate_config(quickstart_raw(**changes)))


def test_validate_finds_chat_prompts_without_a_template_missing_model_files_and_unrouted_sources(tmp_path):
    path = tmp_path / "trl.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in trl_rows()))
    data = {"source": "jsonl", "params": {"path": str(path), "answer_key": "solution", "data_source": "digits"},
            "prompts_per_step": 4, "max_prompt_length": 16}
    with pytest.raises(ConfigError, match=r"lists of chat messages; set data.apply_chat_template: true"):
        _plan(data=data)
    unrouted = {**data, "apply_chat_template": True, "params": {**data["params"], "data_source": "nowhere"}}
    with pytest.raises(ConfigError, match=r"stages\[reward\]: no scorer for data_source\(s\) \['nowhere'\]"):
        _plan(data=unrouted)
    folder = tmp_path / "model"
    with pytest.raises(ConfigError, match=r"model.path '.*model' is not a folder on this machine"):
        _plan(model={"path": str(folder), "architecture": None})
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(ConfigError, match=r"has config.json but no weights"):
        _plan(model={"path": str(folder), "architecture": None})
    with pytest.raises(ConfigError, match=r"tokenizer.path '.*' has no tokenizer.json or tokenizer_config.json"):
        _plan(tokenizer={"path": str(folder), "chars": None})
