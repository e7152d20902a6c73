"""The embedded rollout engine: logprobs, reproducibility, abort/resume, weight pushes, sleep."""

import numpy as np
import pyarrow as pa
import pytest
import torch

from rlpipe.inference import sampling
from rlpipe.inference.embedded import EmbeddedEngine, EngineError, GenerationRequest, SamplingParams
from rlpipe.backends.model import build_model
from rlpipe.backends.tokenizer import build_tokenizer
from rlpipe.backends.weights import export_buckets
from rlpipe.jagged import SequenceInputs, from_flat
from rlpipe.schemas.config import ArchitectureConfig, ModelConfig, TokenizerConfig

TOK = build_tokenizer(TokenizerConfig(chars="abcdefgh 0123456789+="))
PROMPTS = ["1+2=", "abc de", "9", "h 77 + 1 ="]


def model(seed=0):
    arch = ArchitectureConfig(
        hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, max_position_embeddings=64
    )
    return build_model(ModelConfig(architecture=arch), TOK, seed)


def engine(seed=0, version=0):
    return EmbeddedEngine(model(seed), TOK, version=version)


def requests(n=12, max_tokens=16, seed=7, prefix="r", **sampling_kw):
    params = SamplingParams(seed=seed, **sampling_kw)
    return [
        GenerationRequest(f"{prefix}{i}", TOK.encode(PROMPTS[i % len(PROMPTS)]), max_tokens, params) for i in range(n)
    ]


def forward_logits(m, reqs, results):
    """Full forward over prompt + response (no KV cache); returns (SequenceInputs, logits)."""
    prompts = [np.asarray(r.prompt_ids) for r in reqs]
    p = from_flat(np.concatenate(prompts), np.array([len(x) for x in prompts]), pa.int32())
    lens = np.array([len(r.response_ids) for r in results])
    resp = from_flat(np.concatenate([r.response_ids for r in results]), lens, pa.int32())
    seq = SequenceInputs(p, resp, TOK.pad_token_id)
    with torch.no_grad():
        out = m(input_ids=seq.input_ids, attention_mask=seq.attention_mask, position_ids=seq.position_ids)
    return seq, out.logits


def padded(results, field):
    width = max(len(r.response_ids) for r in results)
    out = torch.zeros(len(results), width)
    for i, r in enumerate(results):
        out[i, : len(r.response_ids)] = torch.from_numpy(getattr(r, field).astype(np.float32))
    return out


def test_logprobs_equal_a_full_forward_recomputation():
    eng = engine()
    reqs = requests()
    results = eng.generate(reqs)
    seq, logits = forward_logits(eng.model, reqs, results)
    assert torch.allclose(seq.response_logprobs(logits), padded(results, "logprobs"), atol=1e-5)
    assert {r.finish_reason for r in results} <= {"stop", "length"}


def test_logprob_is_of_the_tempered_top_k_distribution():
    eng = engine()
    reqs = requests(temperature=0.7, top_k=5)
    results = eng.generate(reqs)
    seq, logits = forward_logits(eng.model, reqs, results)
    for i, r in enumerate(results):
        row = logits[i, seq.prompt_width - 1 : seq.prompt_width - 1 + len(r.response_ids)] / 0.7
        top = row.topk(5, dim=-1).values
        picked = row.gather(1, torch.from_numpy(r.response_ids).long()[:, None]).squeeze(1)
        assert (picked >= top[:, -1]).all()  # every token is among the 5 most likely
        assert torch.allclose(torch.from_numpy(r.logprobs), picked - top.logsumexp(-1), atol=1e-5)


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    n = logits.shape[0]
    u = sampling.uniforms(torch.full((n,), 3), torch.arange(n))
    token, logprob = sampling.sample(logits, torch.ones(n), torch.zeros(n, dtype=torch.long), torch.full((n,), 0.7), u)
    assert set(token.tolist()) == {0, 1}  # 0.5 < 0.7 <= 0.5 + 0.3
    assert torch.allclose(logprob[token == 0], torch.log(torch.tensor(0.5 / 0.8)))
    assert abs((token == 0).float().mean().item() - 0.625) < 0.03


def test_same_seed_same_trajectories_independent_of_the_batch():
    a = engine().generate(requests(seed=1))
    b = engine().generate(requests(seed=1))
    c = engine().generate(requests(seed=2))
    for x, y in zip(a, b):
        assert np.array_equal(x.response_ids, y.response_ids) and np.array_equal(x.logprobs, y.logprobs)
    assert any(not np.array_equal(x.response_ids, y.response_ids) for x, y in zip(a, c))
    alone = engine().generate(requests(seed=1)[5:6])[0]  # a request's stream does not depend on its neighbours
    assert np.array_equal(alone.response_ids, a[5].response_ids)


def test_requests_with_equal_prompts_are_prefilled_once_and_sample_as_if_alone():
    eng = engine()
    rows_in = []  # batch rows of every forward: the prefill's, then one per decode step
    hook = eng.model.get_input_embeddings().register_forward_hook(lambda m, i, o: rows_in.append(i[0].shape))
    together = eng.generate(requests(n=12, seed=3))  # 4 prompts × 3 requests
    hook.remove()
    assert rows_in[0][0] == 4  # the prefill ran each distinct prompt once
    # every request not done after its first token decodes on its own row of the repeated cache
    assert rows_in[1][0] == sum(len(r.response_ids) > 1 for r in together) > 4
    for i, result in enumerate(together):
        alone = engine().generate(requests(n=12, seed=3)[i : i + 1])[0]
        assert np.array_equal(alone.response_ids, result.response_ids)
        np.testing.assert_allclose(alone.logprobs, result.logprobs, rtol=0, atol=1e-5)


def test_stop_and_length_finish_reasons():
    results = engine().generate(requests(n=32, max_tokens=12))
    eos = TOK.eos_token_id
    for r in results:
        assert len(r.response_ids) == len(r.logprobs) == len(r.versions) and (r.versions == 0).all()
        assert eos not in r.response_ids[:-1].tolist()
        if r.finish_reason == "stop":
            assert r.response_ids[-1] == eos
        else:
            assert r.finish_reason == "length" and len(r.response_ids) == 12 and r.response_ids[-1] != eos
    assert {r.finish_reason for r in results} == {"stop", "length"}


def test_requests_joining_mid_flight_get_the_same_tokens_as_alone():
    eng = engine()
    first, second = requests(n=6, prefix="a"), requests(n=6, prefix="b", seed=3)
    eng.submit(first)
    done = eng.step() + eng.step() + eng.step()
    eng.submit(second)
    while eng.has_active():
        done += eng.step()
    by_id = {r.request_id: r for r in done}
    for solo in engine().generate(first) + engine().generate(second):
        assert np.array_equal(by_id[solo.request_id].response_ids, solo.response_ids)
        assert np.allclose(by_id[solo.request_id].logprobs, solo.logprobs, atol=1e-5)


def test_cohorts_joining_at_different_steps_decode_in_one_forward_and_sample_as_if_alone():
    """Three cohorts (prompts of other lengths, other budgets, one joining while another is half done): once
    they run together every step is one decode forward over all of them (continuous batching), and every
    request still gets exactly its tokens alone."""
    eng = engine()
    forwards = []
    eng.model.model.embed_tokens.register_forward_hook(lambda *_: forwards.append(1))
    a = requests(n=5, prefix="a", max_tokens=20)
    b = [GenerationRequest(f"b{i}", TOK.encode("77 + 1 = abc"), 9, SamplingParams(seed=3)) for i in range(3)]
    c = requests(n=4, prefix="c", max_tokens=14, seed=5)
    eng.submit(a)
    done = eng.step() + eng.step() + eng.step()
    eng.submit(b)
    done += eng.step() + eng.step()
    eng.submit(c)
    done += eng.step()  # c's prefill (and a+b's decode, merged by now)
    forwards.clear()
    steps = 0
    while eng.has_active():
        done += eng.step()
        steps += 1
    assert len(forwards) == steps  # one forward a step for every running row, not one per cohort
    by_id = {r.request_id: r for r in done}
    assert len(by_id) == 12
    for solo in engine().generate(a) + engine().generate(b) + engine().generate(c):
        assert np.array_equal(by_id[solo.request_id].response_ids, solo.response_ids), solo.request_id
        assert np.allclose(by_id[solo.request_id].logprobs, solo.logprobs, atol=1e-5)


def test_a_cohort_that_requests_keep_joining_keeps_only_the_positions_its_rows_attend_to():
    """Arrivals every step keep one merged cohort alive for the whole stream; the positions of finished rows
    (left padding for the rest) are dropped at each merge, so the cache stays as long as its longest live row."""
    eng = engine()
    longest_row = max(len(TOK.encode(p)) for p in PROMPTS) + 4
    lengths = []
    for step in range(40):
        eng.submit(requests(n=2, prefix=f"s{step}-", max_tokens=4, ignore_eos=True))
        eng.step()
        lengths.append(eng._cohorts[0].cache.length)
    assert max(lengths) <= longest_row, lengths


def abort_after(eng, reqs, steps):
    eng.submit(reqs)
    finished = [r for _ in range(steps) for r in eng.step()]
    return finished, eng.abort_all()


def test_abort_returns_partial_results_and_resume_without_a_push_continues_the_same_stream():
    reqs = requests(max_tokens=20)
    full = {r.request_id: r for r in engine().generate(reqs)}
    eng = engine()
    finished, aborted = abort_after(eng, reqs, 4)
    assert not eng.has_active() and len(finished) + len(aborted) == len(reqs)
    for r in aborted:
        assert r.finish_reason == "abort" and len(r.response_ids) == 4
        assert np.array_equal(r.response_ids, full[r.request_id].response_ids[:4])
    by_id = {r.request_id: r for r in reqs}
    resumed = eng.generate([r.resume(by_id[r.request_id]) for r in aborted])
    for r in resumed:
        assert np.array_equal(r.response_ids, full[r.request_id].response_ids)
        assert np.allclose(r.logprobs, full[r.request_id].logprobs, atol=1e-5)


def test_resume_after_a_push_switches_versions_exactly_at_the_push():
    reqs = requests(max_tokens=20)
    eng = engine(seed=0, version=3)
    _, aborted = abort_after(eng, reqs, 5)
    assert aborted and all((a.versions == 3).all() for a in aborted)
    eng.load_weights(export_buckets(model(1)), version=4)
    by_id = {r.request_id: r for r in reqs}
    resumed = eng.generate([a.resume(by_id[a.request_id]) for a in aborted])
    for before, after in zip(aborted, resumed):
        assert np.array_equal(after.response_ids[:5], before.response_ids)  # the partial part is kept as is
        assert after.versions.tolist() == [3] * 5 + [4] * (len(after.response_ids) - 5)
    # the new tokens' logprobs are those of the new weights, over the old prefix (re-prefilled, not a stale cache)
    seq, logits = forward_logits(eng.model, [by_id[r.request_id] for r in resumed], resumed)
    recomputed = seq.response_logprobs(logits)
    assert torch.allclose(recomputed[:, 5:], padded(resumed, "logprobs")[:, 5:], atol=1e-5)


def test_load_weights_while_active_raises():
    eng = engine()
    eng.submit(requests(n=2))
    with pytest.raises(EngineError, match="abort or finish in-flight requests before a weight push"):
        eng.load_weights(export_buckets(model(1)), version=1)
    eng.step()
    with pytest.raises(EngineError, match="abort or finish in-flight requests before a weight push"):
        eng.load_weights(export_buckets(model(1)), version=1)
    assert eng.version == 0


def test_invalid_requests_say_what_to_do():
    eng = engine()
    with pytest.raises(EngineError, match="exceeds the model's max_position_embeddings \\(64\\)"):
        eng.submit([GenerationRequest("long", TOK.encode("1+2="), max_tokens=61)])
    with pytest.raises(EngineError, match="temperature > 0"):
        eng.submit(requests(n=1, temperature=0.0))
    eng.submit(requests(n=1))
    with pytest.raises(EngineError, match="already in flight"):
        eng.submit(requests(n=1))
    with pytest.raises(EngineError, match="versions only grow"):
        engine(version=2).load_weights(export_buckets(model(0)), version=1)


def test_sleep_wake_and_discarded_weights():
    eng = engine()
    before = eng.generate(requests(n=4))
    eng.sleep()
    with pytest.raises(EngineError, match="asleep; call wake"):
        eng.generate(requests(n=1))
    eng.wake()
    weights = export_buckets(eng.model)
    eng.sleep(discard_weights=True)
    assert all(p.numel() == 0 for p in eng.model.parameters())
    eng.wake()
    with pytest.raises(EngineError, match="push weights"):
        eng.generate(requests(n=1))
    eng.load_weights(weights, version=1)
    after = eng.generate(requests(n=4))
    assert all(np.array_equal(x.response_ids, y.response_ids) for x, y in zip(before, after))
    assert (after[0].versions == 1).all()


def test_resumed_requests_that_are_already_complete_finish_without_decoding():
    eng = engine()
    prompt = TOK.encode("1+2=")
    full = GenerationRequest("full", prompt, 3, response_ids=[5, 6, 7], logprobs=[-1.0] * 3, versions=[0] * 3)
    eos = TOK.eos_token_id
    ended = GenerationRequest("ended", prompt, 9, response_ids=[5, eos], logprobs=[-1.0] * 2, versions=[0] * 2)
    a, b = eng.generate([full, ended])
    assert (a.finish_reason, b.finish_reason) == ("length", "stop")
    assert a.response_ids.tolist() == [5, 6, 7] and b.response_ids.tolist() == [5, eos]
    with pytest.raises(EngineError, match="as many logprobs and versions"):
        eng.submit([GenerationRequest("bad", prompt, 9, response_ids=[5], logprobs=[], versions=[])])


def test_a_request_waits_for_its_environment_without_stepping_and_keeps_its_clock_across_an_abort():
    import dataclasses
    import time

    reqs = requests(n=4, max_tokens=6)
    start = time.monotonic()
    late = [dataclasses.replace(r, ready_at=start + 0.3) for r in reqs[2:]]
    eng = engine()
    eng.submit(reqs[:2] + late)
    assert eng.num_waiting() == 2 and eng.next_ready_in() == 0  # the two early ones can step now...
    first = [r for _ in range(6) for r in eng.step()]
    assert sorted(r.request_id for r in first) == ["r0", "r1"]  # ...and finish before the late ones start
    assert eng.num_running() == 2 and 0 < eng.next_ready_in() <= 0.3
    aborted = eng.abort_all()  # a push while they wait: no tokens yet, the clock is the request's
    assert [len(r.response_ids) for r in aborted] == [0, 0]
    resumed = [a.resume(r) for a, r in zip(aborted, late)]
    assert [r.ready_at for r in resumed] == [start + 0.3] * 2
    rest = eng.generate(resumed)  # sleeps until ready_at, then decodes
    assert time.monotonic() - start >= 0.3
    alone = engine().generate(reqs[2:])
    for got, want in zip(rest, alone):  # latency changes when, never what
        assert np.array_equal(got.response_ids, want.response_ids)
    assert eng.next_ready_in() == float("inf")


def test_a_partial_ending_in_eos_resumes_under_ignore_eos():
    eos = TOK.eos_token_id
    req = requests(n=1, max_tokens=8, ignore_eos=True)[0]
    partial = GenerationRequest(req.request_id, req.prompt_ids, 8, req.sampling, response_ids=[5, eos],
                                logprobs=[-1.0, -1.0], versions=[0, 0])
    out = engine().generate([partial])[0]
    assert out.finish_reason == "length" and len(out.response_ids) == 8
    stopped = engine().generate([GenerationRequest(**{**partial.__dict__, "sampling": SamplingParams(seed=7)})])[0]
    assert stopped.finish_reason == "stop" and len(stopped.response_ids) == 2
