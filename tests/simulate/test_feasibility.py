"""``rlpipe validate`` refuses what cannot make progress, decided from the config alone (one line, exit 2)."""

from __future__ import annotations

import pytest

from rlpipe.cli import main

ASYNC = "pipelines/quickstart_async.yaml"


@pytest.mark.parametrize("overrides,expected", [
    (["mode=colocate_async", "mode_params.max_off_policy_threshold=1", "mode_params.strategy=drop"],
     "drops every one of them and the trainer waits forever; set mode_params.max_off_policy_threshold: 2"),
    (["mode=colocate_async", "mode_params.max_off_policy_threshold=1", "mode_params.strategy=wait"],
     "refuses them and the run fails at step 0"),
    (["mode_params.sampler_params={groups_per_step: 4}"], "2 × 4 = 8 prompts but a step trains on "
                                                           "data.prompts_per_step=16 groups"),
    (["mode_params.sampler_params={group_size: 16}"], "group_size=16 (mode_params.sampler_params) is not the "
                                                      "generate stage's n=8: it never completes a group"),
])
def test_validate_refuses_with_the_numbers_and_the_fix(overrides, expected, capsys):
    argv = ["validate", ASYNC] + [a for o in overrides for a in ("-o", o)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in " ".join(err.split()) and err.strip().count("\n") == 0


def test_what_can_progress_still_validates(capsys):
    assert main(["validate", ASYNC, "-o", "mode=colocate_async", "-o", "mode_params.overlap=false",
                 "-o", "mode_params.max_off_policy_threshold=1"]) == 0
