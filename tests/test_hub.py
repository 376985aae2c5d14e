"""Hub ids (`--model org/name`, `--revision`, `--gguf-file`) against a Hugging Face cache folder
laid out as `huggingface_hub` lays it out, made here, with offline mode on (no hub is reachable).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import torch
from huggingface_hub.utils import filter_repo_objects
from safetensors.torch import load_file

from batchinfer import LLM, SamplingParams
from batchinfer.cli.main import main
from batchinfer.core.config import EngineConfig
from batchinfer.models import load_model
from batchinfer.models.encoder import Encoder, default_encoder_path
from batchinfer.models.hub import (
    ENCODER_FILES,
    FOLDER_FILES,
    HubSettings,
    is_hub_id,
    resolve_source,
)
from batchinfer.models.registry import SourceKind
from batchinfer.server.app import ServerConfig, build_app
from tests.fake_hub import FakeHub
from tests.test_server import run_server
from tests.tiny_models import make_tiny_gguf, make_tiny_llama

REPO_ID = "tiny-org/tiny-llama"
COMMIT_MAIN = "a" * 40
COMMIT_V2 = "b" * 40
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def add_snapshot(cache: Path, repo_id: str, commit: str, files: dict[str, Path],
                 refs: tuple[str, ...] = ("main",)) -> Path:
    """Lay `files` (name in the repo -> source file) out as `huggingface_hub` caches a repo:
    `models--org--name/blobs/<hash>`, `snapshots/<commit>/<name>` linking to its blob and
    `refs/<branch>` holding the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for name, source in files.items():
        data = source.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot


def folder_files(folder: Path, small_files: tuple[str, ...] = FOLDER_FILES) -> dict[str, Path]:
    """The files of `folder` a fetch would bring (`small_files` and the weights): the load tests
    then also prove that the loader needs nothing else."""
    names = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    kept = [*filter_repo_objects(names, allow_patterns=list(small_files)), "model.safetensors"]
    return {name: folder / name for name in kept}


@pytest.fixture
def hub_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An offline hub cache under tmp_path, named by HF_HOME (and HF_HUB_CACHE)."""
    cache = tmp_path / "hf-home" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_settings_follow_the_environment_read_now(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"HF_HOME": "/x/hf", "HF_HUB_OFFLINE": "1"}
    assert HubSettings.from_env(env) == HubSettings(Path("/x/hf/hub"), offline=True)
    env = {"HF_HOME": "/x/hf", "HF_HUB_CACHE": "/y/hub", "TRANSFORMERS_OFFLINE": "0",
           "HF_ENDPOINT": "http://mirror:8080"}
    assert HubSettings.from_env(env) == HubSettings(Path("/y/hub"), offline=False,
                                                    endpoint="http://mirror:8080")


def test_engine_config_checks_the_hub_fields() -> None:
    with pytest.raises(ValueError, match="gguf_file must name a .gguf file"):
        EngineConfig(gguf_file="model.bin")
    with pytest.raises(ValueError, match="revision must be a non-empty string"):
        EngineConfig(revision="")
    config = EngineConfig.from_kwargs(model=REPO_ID, revision="v2", gguf_file="m.gguf")
    assert (config.revision, config.gguf_file) == ("v2", "m.gguf")


def test_hub_id_shape() -> None:
    for text in ("Qwen/Qwen2.5-0.5B-Instruct", "org/name", "a_b/c.d-e"):
        assert is_hub_id(text), text
    for text in ("default", "name", "./org/name", "/org/name", "a/b/c", "org/..", "../x",
                 "org/name.", "model.gguf"):
        assert not is_hub_id(text), text


def test_only_the_files_the_loader_reads_are_fetched() -> None:
    """The first fetch's patterns, through huggingface_hub's own matcher, on a real repo's
    listing (a Mistral-style repo that also ships a consolidated checkpoint and .bin weights)."""
    listing = ["config.json", "generation_config.json", "model.safetensors.index.json",
               "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
               "consolidated.safetensors", "pytorch_model.bin", "tokenizer.json",
               "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
               "chat_template.jinja", "README.md", ".gitattributes", "onnx/model.onnx",
               "original/params.json", "model-q4_k_m.gguf"]
    fetched = set(filter_repo_objects(listing, allow_patterns=list(FOLDER_FILES)))
    assert fetched == {"config.json", "generation_config.json", "model.safetensors.index.json",
                       "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                       "special_tokens_map.json", "chat_template.jinja"}


def test_hub_id_and_revision_generate_as_the_folder(tmp_path: Path, hub_env: Path) -> None:
    main_folder = make_tiny_llama(tmp_path / "main", seed=0)
    v2_folder = make_tiny_llama(tmp_path / "v2", seed=1)
    main_snapshot = add_snapshot(hub_env, REPO_ID, COMMIT_MAIN, folder_files(main_folder))
    v2_snapshot = add_snapshot(hub_env, REPO_ID, COMMIT_V2, folder_files(v2_folder),
                               refs=("v2",))
    source = resolve_source(REPO_ID)
    assert (source.kind, source.path, source.name) == (SourceKind.HF_FOLDER, main_snapshot,
                                                       REPO_ID)
    assert resolve_source(REPO_ID, revision="v2").path == v2_snapshot
    assert resolve_source(REPO_ID, revision=COMMIT_V2).path == v2_snapshot

    prompts = ["hello world", "the quick brown fox"]
    by_id = LLM(REPO_ID, dtype="float32", kv_cache_memory=32 << 20)
    direct = LLM(str(main_folder), dtype="float32", kv_cache_memory=32 << 20)
    assert by_id.engine.model_name == REPO_ID
    got = [o.outputs[0].token_ids for o in by_id.generate(prompts, GREEDY, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in direct.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == want and all(len(ids) == 8 for ids in got)
    # --revision v2 loads v2's weights (the same as its folder's), not main's.
    v2 = load_model(REPO_ID, torch.float32, "cpu", revision="v2").model.state_dict()
    v2_direct = load_model(str(v2_folder), torch.float32, "cpu").model.state_dict()
    main = load_model(REPO_ID, torch.float32, "cpu").model.state_dict()
    assert all(torch.equal(v2[name], v2_direct[name]) for name in v2)
    assert not all(torch.equal(v2[name], main[name]) for name in v2)


def test_gguf_file_in_a_hub_repo(tmp_path: Path, hub_env: Path) -> None:
    gguf_path, _ = make_tiny_gguf(tmp_path / "src")
    add_snapshot(hub_env, "tiny-org/tiny-llama-GGUF", COMMIT_MAIN, {"tiny-Q8_0.gguf": gguf_path})
    convert_cache = tmp_path / "batchinfer-cache"
    by_id = load_model("tiny-org/tiny-llama-GGUF", torch.float32, "cpu", cache_dir=convert_cache,
                       gguf_file="tiny-Q8_0.gguf")
    direct = load_model(str(gguf_path), torch.float32, "cpu", cache_dir=convert_cache)
    assert by_id.name == "tiny-org/tiny-llama-GGUF"
    assert by_id.tokenizer.chat_template == direct.tokenizer.chat_template is not None
    got, want = by_id.model.state_dict(), direct.model.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[name], want[name]) for name in got)
    # --gguf-file also picks a file inside a local folder.
    local = resolve_source(str(gguf_path.parent), gguf_file=gguf_path.name)
    assert (local.kind, local.path) == (SourceKind.GGUF, gguf_path)
    # The repo has no config.json: without --gguf-file the error says to pass it.
    with pytest.raises(ValueError, match=r"no config\.json.*--gguf-file.*tiny-Q8_0\.gguf"):
        resolve_source("tiny-org/tiny-llama-GGUF")
    with pytest.raises(ValueError, match=r"file 'other\.gguf' \(--gguf-file\).*not in the "
                       r"Hugging Face cache"):
        resolve_source("tiny-org/tiny-llama-GGUF", gguf_file="other.gguf")


def test_missing_model_offline_is_a_clear_error(hub_env: Path) -> None:
    with pytest.raises(ValueError) as info:
        LLM("nobody/no-such-model", dtype="float32")
    message = str(info.value)
    assert "'nobody/no-such-model' (--model)" in message
    assert f"no such local path, and not in the Hugging Face cache under {hub_env}" in message
    assert "offline mode is on" in message
    with pytest.raises(ValueError, match="revision 'v9'.*not in the Hugging Face cache"):
        resolve_source(REPO_ID, revision="v9")


def test_encoder_by_hub_id(hub_env: Path) -> None:
    """`embed --model` / `--embedding-model` take hub ids too (sentence-transformers' files)."""
    folder = default_encoder_path()
    files = folder_files(folder, ENCODER_FILES)
    assert {"modules.json", "1_Pooling/config.json", "sentence_bert_config.json"} <= set(files)
    add_snapshot(hub_env, "sentence-transformers/all-MiniLM-L6-v2", COMMIT_MAIN, files)
    quick = {"dtype": "float32", "device": "cpu", "linear_kernels": "dense",
             "prepack_weights": False}  # no start-up measurements: the load is under test
    by_id = Encoder("sentence-transformers/all-MiniLM-L6-v2", **quick)
    direct = Encoder(str(folder), **quick)
    assert by_id.name == "all-MiniLM-L6-v2" and by_id.pooling == direct.pooling
    texts = ["a first sentence", "and a second, longer one"]
    assert torch.equal(by_id.encode_ids(by_id.tokenize(texts)),
                       direct.encode_ids(direct.tokenize(texts)))
    with pytest.raises(ValueError, match="'nobody/none' .*not in the Hugging Face cache"):
        Encoder("nobody/none")


def test_cached_snapshot_missing_a_shard(tmp_path: Path, hub_env: Path) -> None:
    folder = make_tiny_llama(tmp_path)
    files = folder_files(folder)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"model.embed_tokens.weight": '
                     '"model-00001-of-00002.safetensors", "lm_head.weight": '
                     '"model-00002-of-00002.safetensors"}}')
    files["model.safetensors.index.json"] = index
    files["model-00001-of-00002.safetensors"] = files.pop("model.safetensors")
    add_snapshot(hub_env, REPO_ID, COMMIT_MAIN, files)
    with pytest.raises(ValueError, match=r"lacks model-00002-of-00002\.safetensors; offline"):
        resolve_source(REPO_ID)


def test_an_existing_local_path_wins(tmp_path: Path, hub_env: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    add_snapshot(hub_env, REPO_ID, COMMIT_MAIN, folder_files(make_tiny_llama(tmp_path / "hub")))
    # make_tiny_llama names its folder tiny-llama: work/tiny-org/tiny-llama spells REPO_ID.
    assert make_tiny_llama(tmp_path / "work" / "tiny-org", seed=3) == tmp_path / "work" / REPO_ID
    monkeypatch.chdir(tmp_path / "work")
    source = resolve_source(REPO_ID)
    assert (source.kind, source.path) == (SourceKind.HF_FOLDER, Path(REPO_ID))
    with pytest.raises(ValueError, match="revision 'v2': applies to hub ids"):
        resolve_source(REPO_ID, revision="v2")


def test_online_fetches_only_what_the_loader_reads(tmp_path: Path, hub_env: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Against a hub on 127.0.0.1: a repo with duplicates the loader never reads (.bin,
    consolidated.safetensors, ONNX, a GGUF, a shard the index does not name), sharded weights;
    then, with the hub gone, online and offline mode find the same snapshot in the cache."""
    folder = make_tiny_llama(tmp_path)
    weights = (folder / "model.safetensors").read_bytes()
    files = {name: path.read_bytes() for name, path in folder_files(folder).items()
             if name != "model.safetensors"}
    files |= {"model-00001-of-00001.safetensors": weights,
              "model.safetensors.index.json": json.dumps({"weight_map": dict.fromkeys(
                  load_file(folder / "model.safetensors"), "model-00001-of-00001.safetensors")
              }).encode(),
              "model-old.safetensors": b"stale", "consolidated.safetensors": b"dup",
              "pytorch_model.bin": b"pickle", "onnx/model.onnx": b"onnx", "README.md": b"# r",
              "tiny-q8_0.gguf": b"gguf"}
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    gguf_repo = {"main": {"tiny-q4_1.gguf": b"q4", "tiny-q8_0.gguf": b"q8", "README.md": b"r"}}
    with FakeHub({REPO_ID: {"main": files}, "tiny-org/tiny-GGUF": gguf_repo}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        source = resolve_source(REPO_ID)
        fetched = {name.removeprefix(REPO_ID + "/") for name in hub.downloads}
        assert fetched == set(files) - {"model-old.safetensors", "consolidated.safetensors",
                                        "pytorch_model.bin", "onnx/model.onnx", "README.md",
                                        "tiny-q8_0.gguf"}
        assert source.path.parent == hub_env / "models--tiny-org--tiny-llama" / "snapshots"
        gguf = resolve_source("tiny-org/tiny-GGUF", gguf_file="tiny-q8_0.gguf")
        assert gguf.path.read_bytes() == b"q8"
        assert hub.downloads[-1] == "tiny-org/tiny-GGUF/tiny-q8_0.gguf"
        with pytest.raises(ValueError, match=r"the repo has no config\.json.*--gguf-file "
                           r"NAME\.gguf \(its GGUF files: tiny-q4_1\.gguf, tiny-q8_0\.gguf\)"):
            resolve_source("tiny-org/tiny-GGUF")
        assert not any(name.endswith(("q4_1.gguf", "README.md")) for name in hub.downloads)
        with pytest.raises(ValueError, match="'nobody/none' .*no such repo on the hub"):
            resolve_source("nobody/none")
        with pytest.raises(ValueError, match="revision 'v9': not found in 'tiny-org/tiny-llama'"):
            resolve_source(REPO_ID, revision="v9")
        with pytest.raises(ValueError, match=r"file 'x\.gguf' \(--gguf-file\).*no such file"):
            resolve_source(REPO_ID, gguf_file="x.gguf")
    # The hub is gone: online, the cached snapshot of the revision is used; so is it offline.
    assert resolve_source(REPO_ID).path == source.path
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_source(REPO_ID).path == source.path
    got = load_model(REPO_ID, torch.float32, "cpu").model.state_dict()
    want = load_model(str(folder), torch.float32, "cpu").model.state_dict()
    assert all(torch.equal(got[name], want[name]) for name in want)


def test_serve_answers_under_the_hub_id(tmp_path: Path, hub_env: Path) -> None:
    folder = make_tiny_llama(tmp_path)
    add_snapshot(hub_env, REPO_ID, COMMIT_MAIN, folder_files(folder))
    direct = LLM(str(folder), dtype="float32", kv_cache_memory=16 << 20)
    want = direct.generate(["hello world"], GREEDY, use_tqdm=False)[0].outputs[0].text
    config = EngineConfig.from_kwargs(model=REPO_ID, revision="main", dtype="float32",
                                      kv_cache_memory=16 << 20)
    with run_server(build_app(config, ServerConfig(batch_api=False))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == [REPO_ID]
        answer = client.completions.create(model=REPO_ID, prompt="hello world", max_tokens=8,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert answer.choices[0].text == want


def cli_generate(model: str, prompt: str = "hello world") -> list[str]:
    return ["generate", "--model", model, "--revision", "main", "--dtype", "float32",
            "--kv-cache-memory", "32M", "--max-tokens", "8", "--temperature", "0",
            "--ignore-eos", prompt]


def test_generate_cli_takes_a_hub_id(tmp_path: Path, hub_env: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    folder = make_tiny_llama(tmp_path)
    add_snapshot(hub_env, REPO_ID, COMMIT_MAIN, folder_files(folder))
    direct = LLM(str(folder), dtype="float32", kv_cache_memory=32 << 20)
    want = direct.generate(["hello world"], GREEDY, use_tqdm=False)[0].outputs[0].text
    assert main(cli_generate(REPO_ID)) == 0
    assert capsys.readouterr().out == want + "\n"
    assert main(cli_generate("nobody/none")) == 2
    error = capsys.readouterr().err
    assert error.startswith("batchinfer generate: error: model 'nobody/none' (--model)")
    assert "not in the Hugging Face cache" in error


@pytest.mark.slow
def test_generate_command_reads_the_hub_environment(tmp_path: Path, hub_env: Path) -> None:
    """The environment of a fresh process (huggingface_hub imported after it is set)."""
    folder = make_tiny_llama(tmp_path)
    add_snapshot(hub_env, REPO_ID, COMMIT_MAIN, folder_files(folder))
    direct = LLM(str(folder), dtype="float32", kv_cache_memory=32 << 20)
    want = direct.generate(["hello world"], GREEDY, use_tqdm=False)[0].outputs[0].text
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent / "src")}
    done = subprocess.run([sys.executable, "-m", "batchinfer.cli.main", *cli_generate(REPO_ID)],
                          capture_output=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode() == want + "\n"
