"""What the engine and the modes tell a step's stages travels typed (rlpipe.stage.StepExtras), not as a string dict."""

from __future__ import annotations

import pytest

from rlpipe.stage import StageContext, StepExtras


def test_extras_are_typed_fields_and_an_unknown_name_fails_where_it_is_passed():
    base = StepExtras(temperature=0.7)
    sync = base.merged({"max_staleness": 1, "max_version_lag": 0, "sleep_after_generate": True})
    assert (sync.temperature, sync.max_staleness, sync.max_version_lag, sync.sleep_after_generate) == (0.7, 1, 0, True)
    assert base.merged(None) is base and base.merged({}) is base
    with pytest.raises(TypeError, match="max_stalenes"):
        base.merged({"max_stalenes": 1})


def test_a_context_built_from_a_dict_gets_typed_extras_and_round_trips_through_json():
    ctx = StageContext(step=3, seed=0, extras={"temperature": 0.5, "eval": True})
    assert ctx.extras == StepExtras(temperature=0.5, eval=True)
    again = StageContext(step=3, seed=0, extras=ctx.extras.as_dict())  # a replayed batch's saved context
    assert again.extras == ctx.extras
