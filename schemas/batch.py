"""The batch: one Arrow table, one row per trajectory.

Jagged per-token columns are ``list<...>`` arrays aligned with the *response*
tokens of their row (``len(response_mask[i]) == len(response_ids[i])``); the
prompt is its own jagged column. Scalar columns describe the row.

Layouts (B rows, P_i prompt tokens, R_i response tokens of row i):

===================  ==================  ===========  ===============================================
column               Arrow type          length/row   meaning
===================  ==================  ===========  ===============================================
uid                  string              scalar       group id: rows sharing it answer the same prompt
sample_index         int32               scalar       index of the sample within its group
data_source          string              scalar       routes the row to a reward scorer
ground_truth         string              scalar       reference answer for rule-based scorers
prompt_ids           list<int32>         P_i          prompt tokens
response_ids         list<int32>         R_i          generated tokens (model + tool tokens)
response_mask        list<int8>          R_i          1 = trained on (model token), 0 = not
response_text        string              scalar       decoded response (policy tokenizer)
rollout_logprobs     list<float32>       R_i          sampled-token logprob from the rollout engine
token_versions       list<int32>         R_i          policy version that produced each token
status               string              scalar       ok | truncated | aborted | failed
prompt_step          int32               scalar       global step at which the prompt was submitted
reward               float32             scalar       sequence-level score
token_rewards        list<float32>       R_i          score placed on the last valid response token
old_logprobs         list<float32>       R_i          logprob under π_old, recomputed by the trainer
ref_logprobs         list<float32>       R_i          logprob under the reference policy
values               list<float32>       R_i          critic values
advantages           list<float32>       R_i          per-token advantages
returns              list<float32>       R_i          per-token returns (critic targets)
is_weights           list<float32>       R_i          rollout-correction importance weights (detached)
sum_pi_squared       list<float32>       R_i          Σ_v π_old(v)² at each response position (optimal token baseline)
dp_rank              int32               scalar       data-parallel rank the row is trained on
generation_spans     list<int32>         2 × turns    [start, end) of each model turn in the response, flattened
num_turns            int32               scalar       model turns of the trajectory (1 for single-turn)
termination          string              scalar       eos | max_turns | max_length | tool_error | aborted
agent                string              scalar       prompt column, optional: the agent producing the row's
                                                      trajectories (registry `agent`); null = generate.params.agent
===================  ==================  ===========  ===============================================

Agentic trajectories (:mod:`rlpipe.agents`) interleave model turns and tool
observations in ``response_ids``: model tokens have ``response_mask`` 1 and the
engine's logprobs and versions; observation tokens have mask 0, logprob 0 and the
version of the turn they answer. ``generation_spans`` is not per-token: it holds
``2 × num_turns`` offsets into the response.

Stages may add columns of their own (declared in their contract); the plan
check then uses the types they declare.
"""

from __future__ import annotations

import pyarrow as pa

UID = "uid"
SAMPLE_INDEX = "sample_index"
DATA_SOURCE = "data_source"
GROUND_TRUTH = "ground_truth"
PROMPT_IDS = "prompt_ids"
RESPONSE_IDS = "response_ids"
RESPONSE_MASK = "response_mask"
RESPONSE_TEXT = "response_text"
ROLLOUT_LOGPROBS = "rollout_logprobs"
TOKEN_VERSIONS = "token_versions"
STATUS = "status"
PROMPT_STEP = "prompt_step"
REWARD = "reward"
TOKEN_REWARDS = "token_rewards"
OLD_LOGPROBS = "old_logprobs"
REF_LOGPROBS = "ref_logprobs"
VALUES = "values"
ADVANTAGES = "advantages"
RETURNS = "returns"
IS_WEIGHTS = "is_weights"
SUM_PI_SQUARED = "sum_pi_squared"
DP_RANK = "dp_rank"
GENERATION_SPANS = "generation_spans"
NUM_TURNS = "num_turns"
TERMINATION = "termination"
AGENT = "agent"
EXTRA_INFO = "extra_info"  # a row's details for the reward function (JSON object text), when its dataset has them

# Row statuses.
STATUS_OK = "ok"
STATUS_TRUNCATED = "truncated"  # hit max_tokens without end-of-sequence
STATUS_ABORTED = "aborted"  # aborted by a weight push; resumable
STATUS_FAILED = "failed"  # infrastructure failure (sandbox died, transport error)

COLUMN_TYPES: dict[str, pa.DataType] = {
    UID: pa.string(),
    SAMPLE_INDEX: pa.int32(),
    DATA_SOURCE: pa.string(),
    GROUND_TRUTH: pa.string(),
    PROMPT_IDS: pa.list_(pa.int32()),
    RESPONSE_IDS: pa.list_(pa.int32()),
    RESPONSE_MASK: pa.list_(pa.int8()),
    RESPONSE_TEXT: pa.string(),
    ROLLOUT_LOGPROBS: pa.list_(pa.float32()),
    TOKEN_VERSIONS: pa.list_(pa.int32()),
    STATUS: pa.string(),
    PROMPT_STEP: pa.int32(),
    REWARD: pa.float32(),
    TOKEN_REWARDS: pa.list_(pa.float32()),
    OLD_LOGPROBS: pa.list_(pa.float32()),
    REF_LOGPROBS: pa.list_(pa.float32()),
    VALUES: pa.list_(pa.float32()),
    ADVANTAGES: pa.list_(pa.float32()),
    RETURNS: pa.list_(pa.float32()),
    IS_WEIGHTS: pa.list_(pa.float32()),
    SUM_PI_SQUARED: pa.list_(pa.float32()),
    DP_RANK: pa.int32(),
    GENERATION_SPANS: pa.list_(pa.int32()),
    NUM_TURNS: pa.int32(),
    TERMINATION: pa.string(),
    AGENT: pa.string(),
    EXTRA_INFO: pa.string(),
}

# Columns every prompt batch (the data loader's output) carries. A prompt batch may also carry AGENT (when the
# dataset names an agent per row) and EXTRA_INFO (when its rows have details for the reward function); generate
# reads the first and passes the second on when present, so neither is required here.
PROMPT_COLUMNS = (UID, DATA_SOURCE, GROUND_TRUTH, PROMPT_IDS, PROMPT_STEP)


def column_type(name: str) -> pa.DataType:
    """The canonical Arrow type of a well-known column."""
    return COLUMN_TYPES[name]


def is_token_level(name: str) -> bool:
    """True for jagged per-response-token columns."""
    return name in COLUMN_TYPES and pa.types.is_list(COLUMN_TYPES[name]) and name not in (PROMPT_IDS, GENERATION_SPANS)
