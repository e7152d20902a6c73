"""rlpipe.engine.files: a model folder packed once, materialized verified in a node cache, shared by workers; the
worker config that names the copies."""

import hashlib
import threading
import time
from pathlib import Path

import pytest

from rlpipe.engine.files.dir_pack import DirPackError, materialize, pack


@pytest.fixture
def model_dir(tmp_path):
    folder = tmp_path / "driver" / "tiny-model"
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "qwen2"}')
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 40)  # 10 KiB: several 4 KiB chunks
    (folder / "sub" / "tokenizer.json").write_text("{}")
    return folder


class Store:
    """A stand-in object store: ``put`` keeps the bytes under a key; ``get`` returns them (counted, optionally slow)."""

    def __init__(self, delay_s: float = 0.0):
        self.blobs, self.gets, self.delay_s = {}, 0, delay_s
        self.lock = threading.Lock()

    def put(self, data: bytes) -> int:
        self.blobs[len(self.blobs)] = bytes(data)
        return len(self.blobs) - 1

    def get(self, key: int) -> bytes:
        with self.lock:
            self.gets += 1
        time.sleep(self.delay_s)
        return self.blobs[key]


def _tree(folder):
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_materialized_copy_has_every_file_with_its_checksum_elsewhere(model_dir, tmp_path):
    store = Store()
    packed = pack(model_dir, store.put, chunk_bytes=4096)
    assert len(packed.files) == 3 and sum(len(f.chunks) for f in packed.files) == 5
    copy = materialize(packed, store.get, tmp_path / "node-cache")
    assert copy.parent == tmp_path / "node-cache" and copy != model_dir
    assert _tree(copy) == _tree(model_dir)
    assert not list((tmp_path / "node-cache").glob("*.tmp-*"))  # the private folder was renamed into place
    gets = store.gets
    assert materialize(packed, store.get, tmp_path / "node-cache") == copy and store.gets == gets  # reused


def test_a_changed_source_file_gets_a_copy_of_its_own(model_dir, tmp_path):
    store = Store()
    first = materialize(pack(model_dir, store.put), store.get, tmp_path / "cache")
    (model_dir / "config.json").write_text('{"model_type": "llama"}')
    second = materialize(pack(model_dir, store.put), store.get, tmp_path / "cache")
    assert first != second and (second / "config.json").read_text() == '{"model_type": "llama"}'


def test_a_chunk_that_arrives_altered_is_refused_naming_the_file(model_dir, tmp_path):
    store = Store()
    packed = pack(model_dir, store.put, chunk_bytes=4096)
    target = next(f for f in packed.files if f.name == "model.safetensors")
    store.blobs[target.chunks[1]] = b"\xff" + store.blobs[target.chunks[1]][1:]
    with pytest.raises(DirPackError, match=r"tiny-model/model\.safetensors received on this node has a different "
                                           r"sha256"):
        materialize(packed, store.get, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == [tmp_path / "cache" / f"{packed.cache_name}.lock"]  # nothing kept
    store.blobs[target.chunks[1]] = store.blobs[target.chunks[1]][:-1]
    with pytest.raises(DirPackError, match=r"model\.safetensors received on this node has 10239 bytes instead of "
                                           r"10240"):
        materialize(packed, store.get, tmp_path / "cache")


def test_workers_of_one_node_materializing_at_once_fetch_the_model_once(model_dir, tmp_path):
    """Four workers start together on one node (one cache): one fetches and writes, the others wait on the lock and
    reuse its copy; a fetch that is slow keeps the others waiting, not copying."""
    store = Store(delay_s=0.05)
    packed = pack(model_dir, store.put, chunk_bytes=4096)
    results, errors = [], []

    def worker():
        try:
            results.append(materialize(packed, store.get, tmp_path / "node-cache", timeout_s=30))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors and len(results) == 4 and len(set(results)) == 1
    assert store.gets == sum(len(f.chunks) for f in packed.files)  # every chunk fetched once, by one worker
    assert _tree(results[0]) == _tree(model_dir)


def test_a_lock_held_too_long_is_a_bounded_wait_naming_the_lock(model_dir, tmp_path):
    import fcntl

    packed = pack(model_dir, Store().put)
    cache = tmp_path / "cache"
    cache.mkdir()
    with open(cache / f"{packed.cache_name}.lock", "a+b") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        with pytest.raises(DirPackError, match=r"waited 0 s for .*\.lock \(another worker on this node"):
            materialize(packed, Store().get, cache, timeout_s=0.2)


def test_packing_a_folder_the_driver_does_not_have_names_it(tmp_path):
    with pytest.raises(DirPackError, match=r"cannot pack '.*missing' for the workers: it is not a directory"):
        pack(tmp_path / "missing", Store().put)


def test_a_worker_config_names_the_node_copies_of_every_model_folder_and_keeps_file_paths(model_dir, tmp_path):
    """model.path, tokenizer.path and stage params named path / model_path that are folders on the driver (a reward
    model, an SGLang server's model) are shipped and replaced; a dataset file stays the driver's."""
    from rlpipe.engine.files.ship import localize, ship_model_dirs
    from rlpipe.schemas.config import PipelineConfig

    rm_dir = tmp_path / "driver" / "reward-model"
    rm_dir.mkdir()
    (rm_dir / "config.json").write_text("{}")
    data_file = tmp_path / "driver" / "data.jsonl"
    data_file.write_text("{}\n")
    config = PipelineConfig.model_validate({
        "model": {"path": str(model_dir)}, "tokenizer": {"path": str(model_dir)},
        "data": {"source": "jsonl", "params": {"path": str(data_file)}},
        "resources": {"node_cache_dir": str(tmp_path / "node-cache")},
        "stages": [{"kind": "reward", "impl": "weighted", "params": {"reward_model": {"path": str(rm_dir)}}},
                   {"kind": "generate", "impl": "sglang", "params": {"server": {"model_path": str(model_dir)}}}]})
    store = Store()
    shipped = ship_model_dirs(config, store.put)
    assert sorted(shipped.dirs) == sorted([str(model_dir), str(rm_dir)])  # model_dir named 3 times, packed once
    raw = config.model_dump(mode="json")
    local_config, local = localize(raw, shipped, store.get)
    cache = tmp_path / "node-cache"
    assert local_config["model"]["path"] == local_config["tokenizer"]["path"] == local[str(model_dir)]
    assert local_config["stages"][1]["params"]["server"]["model_path"] == local[str(model_dir)]
    assert local_config["stages"][0]["params"]["reward_model"]["path"] == local[str(rm_dir)]
    assert all(path.startswith(str(cache) + "/") for path in local.values())
    assert local_config["data"]["params"]["path"] == str(data_file)
    assert raw["model"]["path"] == str(model_dir)  # the driver's config is left as it was
    assert _tree(Path(local[str(rm_dir)])) == _tree(rm_dir)
