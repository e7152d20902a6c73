"""The prompt source: a registered dataset, tokenized once, drawn per step.

Each global step draws ``data.prompts_per_step`` prompts in a seeded, per-epoch
shuffled order. Every draw gets a fresh ``uid`` (``<step>-<i>``), so a prompt
seen in two epochs forms two groups. The position (epoch, cursor) is part of a
checkpoint.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa

from rlpipe.agents.chat import render
from rlpipe.errors import ConfigError
from rlpipe.jagged import from_flat
from rlpipe.schemas.batch import AGENT, DATA_SOURCE, EXTRA_INFO, GROUND_TRUTH, PROMPT_IDS, PROMPT_STEP, UID
from rlpipe.schemas.config import DataConfig
from rlpipe.stages.dataset_records import PROMPT_MESSAGES
from rlpipe.stages.datasets import load_dataset


def tokenize_prompts(texts: list[str], tokenizer, chat_template: bool,
                     messages: list[str | None] | None = None) -> list[list[int]]:
    """Token ids of each prompt (the HF fast tokenizer batches in Rust). With ``chat_template`` a prompt is
    rendered by the tokenizer's chat template (rlpipe's default where it has none, as the gateway does): its
    ``messages`` (JSON, a chat dataset's rows) or else its text as one user message. A row with messages and
    no ``chat_template`` is a ConfigError: training on the JSON text of a chat is never what was meant."""
    chats = [json.loads(m) if m is not None else None for m in messages] if messages is not None else None
    if not chat_template:
        first = next((i for i, m in enumerate(chats or ()) if m is not None), None)
        if first is not None:
            raise ConfigError(f"data: the prompt of row {first + 1} (and every row like it) is a list of chat messages; set "
                              "data.apply_chat_template: true so the tokenizer's chat template renders them")
        return tokenizer(texts, add_special_tokens=False)["input_ids"]
    rendered = [render(tokenizer, chat if chat is not None else [{"role": "user", "content": text}])
                for text, chat in zip(texts, chats or [None] * len(texts))]
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


class PromptLoader:
    """Draws prompt batches (Arrow tables with the prompt columns) step by step."""

    def __init__(self, data: DataConfig, tokenizer, seed: int):
        self.data = data
        self.seed = seed
        table = load_dataset(data.source, data.params, seed)
        messages = table.column(PROMPT_MESSAGES).to_pylist() if PROMPT_MESSAGES in table.column_names else None
        ids = tokenize_prompts(table.column("prompt").to_pylist(), tokenizer, data.apply_chat_template, messages)
        lens = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        too_long = np.flatnonzero(lens > data.max_prompt_length)
        if too_long.size:
            i = int(too_long[0])
            raise ConfigError(
                f"data: the prompt of row {i + 1} has {lens[i]} tokens > data.max_prompt_length={data.max_prompt_length} "
                f"({too_long.size} prompts too long); raise data.max_prompt_length or filter the dataset"
            )
        if table.num_rows < data.prompts_per_step:
            raise ConfigError(
                f"data: dataset {data.source!r} has {table.num_rows} prompts, fewer than "
                f"data.prompts_per_step={data.prompts_per_step}; lower prompts_per_step or add data"
            )
        flat = np.concatenate([np.asarray(x, dtype=np.int32) for x in ids]) if ids else np.zeros(0, np.int32)
        self.prompt_ids = from_flat(flat, lens, pa.int32())
        self.ground_truth = table.column("ground_truth").combine_chunks()
        self.data_source = table.column("data_source").combine_chunks()
        # a dataset naming an agent per row (the per-sample `agent` column) passes it on; others have none
        self.agent = table.column(AGENT).combine_chunks() if AGENT in table.column_names else None
        # a dataset whose rows carry details for the reward function (verl's extra_info) passes them on
        self.extra_info = table.column(EXTRA_INFO).combine_chunks() if EXTRA_INFO in table.column_names else None
        self.size = table.num_rows
        self.epoch = 0
        self.cursor = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.data.shuffle:
            return np.arange(self.size)
        return np.random.default_rng([self.seed, epoch]).permutation(self.size)

    def next_indices(self, count: int) -> np.ndarray:
        """The next ``count`` dataset rows, crossing into a new epoch (reshuffled) when needed."""
        out = []
        while count > 0:
            take = min(count, self.size - self.cursor)
            out.append(self._order[self.cursor : self.cursor + take])
            self.cursor += take
            count -= take
            if self.cursor == self.size:
                self.epoch += 1
                self.cursor = 0
                self._order = self._permutation(self.epoch)
        return np.concatenate(out)

    def next_batch(self, step: int, count: int | None = None, uid_prefix: str = "") -> pa.Table:
        """``count`` (default prompts_per_step) prompts submitted at global ``step``."""
        count = self.data.prompts_per_step if count is None else count
        rows = pa.array(self.next_indices(count))
        uids = [f"{uid_prefix}{step}-{i}" for i in range(count)]
        columns = {
            UID: pa.array(uids, pa.string()),
            DATA_SOURCE: self.data_source.take(rows),
            GROUND_TRUTH: self.ground_truth.take(rows),
            PROMPT_IDS: self.prompt_ids.take(rows),
            PROMPT_STEP: pa.array(np.full(count, step, dtype=np.int32)),
        }
        if self.agent is not None:
            columns[AGENT] = self.agent.take(rows)
        if self.extra_info is not None:
            columns[EXTRA_INFO] = self.extra_info.take(rows)
        return pa.table(columns)

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state(self, state: dict) -> None:
        self.epoch = state["epoch"]
        self.cursor = state["cursor"]
        self._order = self._permutation(self.epoch)
