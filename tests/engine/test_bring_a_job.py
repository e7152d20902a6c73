"""A verl or TRL user's data and reward train as they are (issue 23, goal 1).

The same GSM8K-style rows, written by the test in the users' own formats: a verl parquet (chat-message
``prompt``, ``reward_model.ground_truth``, ``data_source``, ``extra_info``), the same rows as a Hugging
Face dataset saved with ``save_to_disk``, and a TRL conversational jsonl (``prompt`` messages, a
``solution`` column). Each trains for two steps in this process, with a BPE tokenizer trained here whose
Qwen-style chat template renders the prompts, and a reward function in the user's signature (verl's
per-row ``compute_score``, TRL's batched ``reward_funcs``) that writes down what it was given.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlpipe.engine.planning.config_io import validate_config
from rlpipe.engine.runtime import run_pipeline

from bpe_tokenizer import train_bpe_tokenizer
from conftest import Recorder, quickstart_raw

PROBLEMS = [(a, b) for a in range(2, 6) for b in range(1, 5)]  # 16 rows

VERL_REWARD = '''
import json
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open({log!r}, "a") as f:
        f.write(json.dumps({{"data_source": data_source, "ground_truth": ground_truth, "extra_info": extra_info,
                            "solution": solution_str}}) + "\\n")
    return {{"score": 1.0 if ground_truth in solution_str else 0.0, "length": float(len(solution_str))}}
'''

TRL_REWARD = '''
import json
def accuracy(prompts, completions, {column}, **kwargs):
    with open({log!r}, "a") as f:
        for p, c, s, i in zip(prompts, completions, {column}, kwargs.get("index", [None] * len(completions))):
            f.write(json.dumps({{"prompt": p, "completion": c, "answer": s, "index": i,
                                "kwargs": sorted(kwargs)}}) + "\\n")
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [1.0 if s in t else 0.0 for t, s in zip(texts, {column})]
'''


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}? Answer after ####."


def verl_rows() -> list[dict]:
    return [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": question(a, b)}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a + b)},
             "extra_info": {"split": "train", "index": i}} for i, (a, b) in enumerate(PROBLEMS)]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bpe")
    train_bpe_tokenizer(folder, [question(a, b) + f" #### {a + b}" for a in range(10) for b in range(10)])
    return folder


def write_dataset(fmt: str, folder) -> dict:
    """The dataset in ``fmt`` under ``folder``; returns its data section (what the user writes in the YAML)."""
    if fmt == "verl parquet":
        pq.write_table(pa.Table.from_pylist(verl_rows()), folder / "train.parquet")
        params = {"path": str(folder / "train.parquet"), "answer_key": "reward_model.ground_truth"}
        return {"source": "parquet", "params": params}
    if fmt == "hf save_to_disk":
        import datasets

        datasets.Dataset.from_list(verl_rows()).save_to_disk(str(folder / "gsm8k_hf"))
        return {"source": "hf", "params": {"path": str(folder / "gsm8k_hf"), "answer_key": "reward_model.ground_truth"}}
    rows = [{"prompt": [{"role": "user", "content": question(a, b)}], "solution": str(a + b), "index": i}
            for i, (a, b) in enumerate(PROBLEMS)]
    (folder / "trl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"source": "jsonl", "params": {"path": str(folder / "trl.jsonl"), "answer_key": "solution",
                                          "data_source": "trl_math"}}


@pytest.mark.parametrize("fmt,style", [("verl parquet", "verl"), ("hf save_to_disk", "trl"), ("trl jsonl", "trl")])
def test_a_users_dataset_and_reward_train_as_they_are(fmt, style, tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    log = tmp_path / "reward_calls.jsonl"
    column = "solution" if fmt == "trl jsonl" else "ground_truth"
    source = VERL_REWARD.format(log=str(log)) if style == "verl" else TRL_REWARD.format(log=str(log), column=column)
    (tmp_path / "my_reward.py").write_text(source)
    name = "compute_score" if style == "verl" else "accuracy"
    data = {**write_dataset(fmt, tmp_path), "prompts_per_step": 4, "max_prompt_length": 48, "apply_chat_template": True}
    raw = quickstart_raw(name="bring-a-job", model={"architecture": {"hidden_size": 32, "num_layers": 1, "num_heads": 2,
                                                                     "intermediate_size": 64,
                                                                     "max_position_embeddings": 64}},
                         data=data,
                         trainer={"total_steps": 2, "micro_batch_size": 16, "output_dir": str(tmp_path / "out")},
                         tracking={"enabled": False})
    raw["tokenizer"] = {"path": str(tokenizer_dir)}
    raw["stages"][0]["params"] = {"n": 2, "max_tokens": 6, "temperature": 1.0}
    raw["stages"][1]["params"] = {"function": {"path": str(tmp_path / "my_reward.py"), "name": name}}
    recorder = Recorder()
    run_pipeline(validate_config(raw), "", observer=recorder, inline=True)
    assert recorder.status == "FINISHED" and sorted(recorder.batches) == [0, 1]

    # the prompts the model saw are the chat template's rendering of each row's messages, token for token
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    truth_of = {str(a + b) for a, b in PROBLEMS}
    for batch in recorder.batches.values():
        for row in batch.select(["prompt_ids", "ground_truth"]).to_pylist():
            text = tok.decode(row["prompt_ids"])
            assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
            assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
            a, b = (int(x) for x in text.split("What is ")[1].split("?")[0].split(" + "))
            assert row["ground_truth"] == str(a + b)  # the dotted answer_key's value, of the same row
            assert row["prompt_ids"] == tok.apply_chat_template([{"role": "user", "content": question(a, b)}],
                                                                add_generation_prompt=True, tokenize=True,
                                                                return_dict=False)

    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 2 * 4 * 2  # every sample of both steps was scored by the user's function
    if style == "verl":
        assert {c["data_source"] for c in calls} == {"openai/gsm8k"}
        assert {c["ground_truth"] for c in calls} <= truth_of
        for c in calls:  # the row's own extra_info, plus the uid and sample index rlpipe adds
            assert c["extra_info"]["split"] == "train" and PROBLEMS[c["extra_info"]["index"]]
            assert sum(PROBLEMS[c["extra_info"]["index"]]) == int(c["ground_truth"])
            assert {"uid", "sample_index"} <= set(c["extra_info"])
        assert "reward/length/mean" in recorder.metrics[1]  # a verl dict's extra key is a metric
    else:
        for c in calls:  # TRL's batched call: the dataset's columns (verl rows: extra_info's fields) as kwargs
            assert sum(PROBLEMS[c["index"]]) == int(c["answer"])
            assert "index" in c["kwargs"]
            if fmt == "trl jsonl":  # a conversational row: prompts are its messages, completions assistant messages
                assert c["prompt"] == [{"role": "user", "content": question(*PROBLEMS[c["index"]])}]
                assert c["completion"][0]["role"] == "assistant"
            else:  # a verl row's extra_info is its own dict, without the prompt: TRL gets text
                assert c["prompt"] is None and isinstance(c["completion"], str)
