"""LoRA on vLLM without a server (rlpipe.inference.vllm_lora): the slots `validate` asks for, the server's flags, each
push's peft folder, and the adapters' bookkeeping (which version a request runs on, when an old one is unloaded, a
push beyond the slots refused). Against a real LoRA-enabled vLLM server: tests/e2e/test_vllm_lora_server.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from rlpipe.backends.lora import adapter_holder, apply_lora, is_adapter, targets
from rlpipe.backends.model import build_model
from rlpipe.backends.tokenizer import build_tokenizer
from rlpipe.backends.weights import pack_buckets
from rlpipe.engine.planning.config_io import validate_config
from rlpipe.engine.planning.plan import build_plan
from rlpipe.errors import ConfigError
from rlpipe.inference.contract import EngineError
from rlpipe.inference.vllm_engine import VLLMParams
from rlpipe.inference.vllm_lora import (VLLMAdapters, adapter_slots_needed, server_lora, server_lora_rank)
from rlpipe.modes.separate_async import SeparateAsyncParams
from rlpipe.modes.sync import SyncParams
from rlpipe.schemas.config import ArchitectureConfig, ModelConfig, TokenizerConfig
from rlpipe.schemas.lora import LoRAConfig

ROOT = Path(__file__).resolve().parents[2]
TOK = build_tokenizer(TokenizerConfig(chars="0123456789="))
ARCH = ArchitectureConfig(hidden_size=64, num_layers=2, num_heads=1, intermediate_size=128, max_position_embeddings=64)
LORA = LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])


def vllm_lora_raw(tmp_path, mode="sync", **server) -> dict:
    raw = yaml.safe_load((ROOT / "pipelines/quickstart_vllm.yaml").read_text())
    raw["trainer"].update({"output_dir": str(tmp_path), "lora": {"rank": 8}})
    raw["mode"] = mode
    if server:
        raw["stages"][0]["params"]["server"] = server
    return raw


def test_validate_takes_lora_with_vllm_and_refuses_too_few_adapter_slots(tmp_path):
    build_plan(validate_config(vllm_lora_raw(tmp_path)))  # sync: one slot, the default
    raw = vllm_lora_raw(tmp_path, mode="separate_async", max_loras=2)
    raw["mode_params"] = {"max_off_policy_threshold": 2}
    with pytest.raises(ConfigError, match=r"^stages\[generate\]\.params\.server\.max_loras=2: a LoRA run on vLLM needs "
                                          r"an adapter slot per policy version .*threshold=2, \+ 1 = 3\); set "
                                          r"max_loras to 3 or more, or leave it out"):
        build_plan(validate_config(raw))
    raw["stages"][0]["params"]["server"]["max_loras"] = 3
    build_plan(validate_config(raw))
    raw = vllm_lora_raw(tmp_path)
    raw["trainer"]["lora"]["rank"] = 600
    with pytest.raises(ConfigError, match=r"^trainer\.lora\.rank=600: vLLM 0\.32 serves LoRA ranks up to 512"):
        build_plan(validate_config(raw))


def test_validate_still_refuses_lora_with_sglang(tmp_path):
    raw = vllm_lora_raw(tmp_path)
    raw["stages"][0]["impl"] = "sglang"
    with pytest.raises(ConfigError, match=r"^trainer\.lora: stages\[generate\] impl sglang cannot take adapter pushes"):
        build_plan(validate_config(raw))


def test_the_cli_names_the_slots_in_one_line_and_exits_two(capsys):
    from rlpipe.cli import main

    assert main(["validate", str(ROOT / "pipelines/quickstart_vllm.yaml"), "-o", "trainer.lora={rank: 8}",
                 "-o", "mode=separate_async", "-o", "mode_params.max_off_policy_threshold=2",
                 "-o", "stages.generate.params.server.max_loras=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: stages[generate].params.server.max_loras=1") and "\n" not in err, err


def test_slots_follow_the_staleness_bound_and_the_rank_one_vllm_serves():
    assert adapter_slots_needed(SyncParams()) == 1
    assert adapter_slots_needed(SeparateAsyncParams(max_off_policy_threshold=3)) == 4
    assert [server_lora_rank(r) for r in (1, 4, 8, 9, 320, 512)] == [1, 8, 8, 16, 320, 512]
    flags = server_lora(LORA, None, SeparateAsyncParams(max_off_policy_threshold=1))
    assert flags.args() == ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
    assert server_lora(LORA, 5, SyncParams()).slots == 5  # as the user set it


def test_the_server_starts_with_the_lora_flags_and_the_runtime_loading_env(tmp_path):
    from rlpipe.inference.vllm_build import VLLMServer

    server = object.__new__(VLLMServer)  # its command and environment, without starting it
    server.name, server.model_dir, server.port = "s", tmp_path, 1234
    server.params = VLLMParams(python=sys.executable)
    server.lora = server_lora(LORA, 3, SyncParams())
    cmd = server.command()
    assert cmd[cmd.index("--enable-lora"):cmd.index("--enable-lora") + 5] == \
        ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "8"]
    assert server._env()["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    server.lora = None
    assert "--enable-lora" not in server.command() and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in server._env()


class FakeServer:
    """What VLLMAdapters calls: requests recorded, answered with nothing."""

    name, url = "vllm-0", "http://127.0.0.1:1"

    def __init__(self, fail: bool = False):
        self.calls, self.fail = [], fail

    def request(self, method, path, body=None, timeout=None):
        if self.fail:
            raise EngineError(f"{self.name}: {method} {path} answered HTTP 404: Not Found")
        self.calls.append((path, body))


def trainer_adapters(seed=1):
    """A LoRA model of ARCH with random (non-zero) B, and its adapter push."""
    model = build_model(ModelConfig(architecture=ARCH), TOK, 0)
    apply_lora(model, LORA, seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B"):
                param.normal_(0, 0.1)
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if is_adapter(n)}
    return adapters, pack_buckets(adapters.items(), bucket_bytes=4096)


def adapter_set(tmp_path, server, slots=2):
    engine_model = build_model(ModelConfig(architecture=ARCH), TOK, 0)  # what a replica builds: no adapters
    holder = adapter_holder(engine_model, targets(engine_model, LORA.target_modules), LORA.rank)
    return VLLMAdapters(server, holder, LORA, tmp_path / "adapters", slots, base_path="/models/base")


def test_a_push_becomes_a_peft_folder_of_the_trainers_adapters(tmp_path):
    adapters, buckets = trainer_adapters()
    folder = adapter_set(tmp_path, FakeServer()).write(buckets, 3)
    assert folder == tmp_path / "adapters" / "v3"
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["target_modules"],
            config["base_model_name_or_path"]) == ("LORA", 4, 8.0, ["down_proj", "q_proj", "v_proj"], "/models/base")
    saved = load_file(folder / "adapter_model.safetensors")
    assert set(saved) == {f"base_model.model.{n}.weight" for n in adapters}
    assert len(saved) == 2 * 2 * 3  # A and B, 2 layers, 3 targets
    for name, tensor in adapters.items():
        torch.testing.assert_close(saved[f"base_model.model.{name}.weight"], tensor, rtol=0, atol=0)


def test_a_bad_adapter_push_is_refused_before_any_file_is_written(tmp_path):
    adapters, buckets = trainer_adapters()
    partial = pack_buckets(list(adapters.items())[:-1])
    with pytest.raises(EngineError, match=r"vllm-0: adapter push of version 1: a full weight push misses 1"):
        adapter_set(tmp_path, FakeServer()).write(partial, 1)
    assert not (tmp_path / "adapters").exists()


def test_requests_keep_their_version_old_adapters_go_when_unused_and_too_many_are_refused(tmp_path):
    server = FakeServer()
    adapters = adapter_set(tmp_path, server, slots=2)
    assert adapters.acquire() is None  # before the first adapter push: the base model
    for version in (1, 2):
        folder = adapters.write(trainer_adapters(version)[1], version)
        adapters.load(version, folder)
        stale = adapters.adopt(version, folder)
        if version == 1:
            assert stale == [] and adapters.acquire() == adapters.name(1)  # a request runs on v1
    assert stale == []  # v1 still serves its request: kept
    assert adapters.acquire() == adapters.name(2)  # new requests run on v2
    adapters.check_room(2)
    with pytest.raises(EngineError, match=r"adapter push of version 3: requests still run on versions \[1, 2\] and the "
                                          r"vLLM server holds 2 adapter\(s\) at once \(max_loras\)"):
        adapters.check_room(3)
    stale = adapters.release(1)  # v1's request ended: v1 goes
    assert stale == [(1, tmp_path / "adapters" / "v1")]
    adapters.unload(stale)
    assert server.calls[-1] == ("/v1/unload_lora_adapter", {"lora_name": adapters.name(1)})
    assert not (tmp_path / "adapters" / "v1").exists() and (tmp_path / "adapters" / "v2").exists()
    adapters.check_room(3)
    assert adapters.name(1).startswith("rlpipe-") and adapters.name(1) != adapter_set(tmp_path, server).name(1)
    adapters.close()
    assert server.calls[-1] == ("/v1/unload_lora_adapter", {"lora_name": adapters.name(2)})
    assert not (tmp_path / "adapters").exists()


def test_a_server_without_lora_is_named_with_what_it_needs(tmp_path):
    adapters = adapter_set(tmp_path, FakeServer(fail=True))
    folder = adapters.write(trainer_adapters()[1], 0)
    with pytest.raises(EngineError, match=r"did not load the LoRA adapter of version 0 \(.*HTTP 404.*\)\. A server that "
                                          r"takes adapter pushes runs with --enable-lora --max-loras 2 --max-lora-rank "
                                          r"8 and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"):
        adapters.load(0, folder)
    assert not folder.exists()
