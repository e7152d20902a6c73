"""Locally generated tasks for agent pipelines: the ``lookup`` dataset (registry kind ``dataset``).

``lookup``: prompts ``"<key>?"`` (``key_digits`` random decimal digits), ground truth the
value a secret table holds for the key (:func:`rlpipe.agents.tools.lookup_value`, a keyed
hash: ``value_digits`` digits that nothing in the prompt predicts). A model answering
from the prompt alone is right by chance (10**-value_digits per answer, 0.1 per digit of
partial credit); calling the ``lookup`` tool (``agent_loop.tools: [lookup]``, same
``secret`` and ``digits``) shows it the value, which it then copies. That is the point:
a task whose reward can only rise by learning to call a tool and use its observation
(``pipelines/agent_tools.yaml``). Rows route to the ``lookup_answer`` scorer below.

Scorer ``lookup_answer``: the answer is the text right after the tool's observation
``={value}`` (the ``trigger`` format; the lookup is deterministic, so its observation is
``=`` + the ground truth); its first ``len(ground_truth)`` characters are scored like
``digits`` (the fraction of matching positions), so text after the answer (the length
budget ends the episode) and special tokens (not in the text) neither help nor hurt. A
response without that observation did not look the key up and scores 0: the task is
"look the key up, then report the value". The scorer reads text, not the mask, so a
model could write the observation itself — but only by guessing the value, which is
what the task makes impossible. Through the gateway (``pipelines/agent_gateway.yaml``) the
default chat template puts ``\nA:`` between the observation and the model's answer; it
is skipped.

Left out: keys repeated within one dataset are not removed (with 3 digits and 1024 rows
about 40% repeat); a model could in principle memorize frequent keys over a long run,
which the ``key_digits`` setting makes as unlikely as wanted.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from pydantic import Field

from rlpipe.agents.tools import lookup_value
from rlpipe.stages.datasets import DatasetParams, _table, dataset
from rlpipe.stages.scorers import SCORERS, TextColumn, digits, texts


GATEWAY_TURN = "\nA:"
"""What rlpipe's default chat template puts before an assistant turn (rlpipe.agents.chat)."""


class LookupParams(DatasetParams):
    key_digits: int = Field(3, ge=1, le=12)
    """Digits of each key (the prompt is the key and `?`)."""
    value_digits: int = Field(1, ge=1, le=12)
    """Digits of each value; must equal the lookup tool's `digits` setting."""
    secret: int = 0
    """Key of the secret table; must equal the lookup tool's `secret` setting."""
    size: int = Field(1024, ge=1)
    """Number of examples."""
    data_source: str = "lookup_answer"
    """The scorer route of every row (`lookup_answer`: the text after the last observation, see the module doc)."""


@dataset("lookup", LookupParams)
def lookup(params: LookupParams, seed: int) -> pa.Table:
    """``"<key>?"`` → the secret table's value for the key."""
    rng = np.random.default_rng(seed)
    digits = rng.integers(0, 10, size=(params.size, params.key_digits))
    keys = ["".join(map(str, row)) for row in digits.tolist()]
    values = [lookup_value(k, params.secret, params.value_digits) for k in keys]
    return _table([f"{k}?" for k in keys], values, params.data_source)


@SCORERS.register("lookup_answer")
def lookup_answer(responses: TextColumn, ground_truths: TextColumn) -> np.ndarray:
    """``digits`` on the answer after the lookup's observation ``={ground truth}`` (0 without one)."""
    truths = texts(ground_truths)
    answers = []
    for response, truth in zip(texts(responses), truths):
        at = response.rfind("=" + truth)
        answer = "" if at < 0 else response[at + 1 + len(truth):]
        answers.append(answer.removeprefix(GATEWAY_TURN)[: len(truth)])
    return digits(answers, truths)
