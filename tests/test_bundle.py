"""Model bundles: the built-in default bundle and loading a Hugging Face model directory."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

from render_service.bundle.default_bundle import QWEN3_TOKENIZER_SHA256, BundleBuildError, default_bundle_dir
from render_service.bundle.model_bundle import BundleError, derive_max_model_len, load_bundle
from render_service.tokenize.byte_level import byte_level_bpe_spec
from tests.shared_paths import QWEN3_FIXTURE_DIR

REPO = Path(__file__).resolve().parents[1]
QWEN3_DIR = QWEN3_FIXTURE_DIR


def fixture_sha256() -> str:
    return hashlib.sha256((QWEN3_DIR / "tokenizer.json").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A private SPLITSERVE_CACHE for this module's builds."""
    root = tmp_path_factory.mktemp("splitserve-cache")
    old = os.environ.get("SPLITSERVE_CACHE")
    os.environ["SPLITSERVE_CACHE"] = str(root)
    yield root
    if old is None:
        os.environ.pop("SPLITSERVE_CACHE", None)
    else:
        os.environ["SPLITSERVE_CACHE"] = old


def run_cli(cache: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "SPLITSERVE_CACHE": str(cache)}
    return subprocess.Popen([sys.executable, "-m", "render_service.bundle.default_bundle", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def built(cache) -> Path:
    """The default bundle, built by two processes racing for the same cache."""
    racers = [run_cli(cache, "--print-path") for _ in range(2)]
    outputs = [racer.communicate(timeout=300) for racer in racers]
    assert [racer.returncode for racer in racers] == [0, 0], outputs
    paths = {out.strip() for out, _ in outputs}
    assert len(paths) == 1
    return Path(paths.pop())


# --- the default bundle ---------------------------------------------------------------------------------------

def test_racing_builds_leave_one_complete_bundle_and_no_temporaries(built, cache):
    entries = [p.name for p in (cache / "bundles").iterdir()]
    assert built.name in entries
    assert not [name for name in entries if name.startswith(".")]  # no temporary build left behind
    assert not [name for name in entries if name.startswith("qwen3-tiny-") and "weights" not in name
                and name != built.name]
    assert sorted(p.name for p in built.iterdir()) == [
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]


def test_rebuilt_tokenizer_is_byte_identical_to_qwen3(built):
    assert QWEN3_TOKENIZER_SHA256 == fixture_sha256()
    assert hashlib.sha256((built / "tokenizer.json").read_bytes()).hexdigest() == fixture_sha256()


def test_default_bundle_dir_returns_the_cached_build(built):
    assert default_bundle_dir() == built


def test_tokenizer_config_carries_qwen3_tokens_and_our_template(built):
    ours = json.loads((built / "tokenizer_config.json").read_text())
    qwen3 = json.loads((QWEN3_DIR / "tokenizer_config.json").read_text())
    assert {k: v for k, v in ours.items() if k != "chat_template"} == {
        k: v for k, v in qwen3.items() if k != "chat_template"}
    template = resources.files("render_service.bundle").joinpath("default_template.jinja")
    if template.is_file():
        assert ours["chat_template"] == template.read_text(encoding="utf-8")


def test_config_is_a_tiny_qwen3(built):
    config = json.loads((built / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert (config["vocab_size"], config["hidden_size"], config["intermediate_size"]) == (151936, 64, 128)
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"],
            config["head_dim"]) == (2, 4, 2, 16)
    assert config["tie_word_embeddings"] is True and config["torch_dtype"] == "bfloat16"
    assert (config["bos_token_id"], config["eos_token_id"]) == (151643, 151645)
    generation = json.loads((built / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [151645, 151643]


def test_default_bundle_loads_with_the_fast_tokenizer(built):
    bundle = load_bundle(built)
    assert bundle.tokenizer.fast_path, bundle.tokenizer.fast_path_reason
    assert bundle.eos_token_ids == [151645, 151643]
    assert bundle.max_model_len == 4096
    assert bundle.template_special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    assert bundle.tokenizer_sha256 == fixture_sha256()
    assert bundle.chat_template and "<|im_start|>" in bundle.chat_template


def test_cli_prints_the_path(built, cache):
    out, err = run_cli(cache, "--print-path").communicate(timeout=120)
    assert out.strip() == str(built), err


def test_engine_cli_adds_weights_matching_the_config(built, cache):
    pytest.importorskip("torch")
    from safetensors import safe_open

    env = {**os.environ, "SPLITSERVE_CACHE": str(cache)}
    path = Path(subprocess.run([sys.executable, "-m", "token_engine.cli", "with-random-weights", str(built)], cwd=REPO,
                               env=env, check=True, capture_output=True, text=True).stdout.strip())
    assert path != built
    assert json.loads((path / "config.json").read_text()) == json.loads((built / "config.json").read_text())
    assert (path / "tokenizer.json").read_bytes() == (built / "tokenizer.json").read_bytes()
    with safe_open(str(path / "model.safetensors"), "pt") as weights:
        embed = weights.get_slice("model.embed_tokens.weight")
        assert embed.get_shape() == [151936, 64]
        assert "model.layers.1.self_attn.k_proj.weight" in weights.keys()
        assert "model.layers.2.self_attn.k_proj.weight" not in weights.keys()


# --- loading model directories --------------------------------------------------------------------------------

def test_qwen3_fixture_loads(cache):
    bundle = load_bundle(QWEN3_DIR)
    assert bundle.eos_token_ids == [151645, 151643]
    assert bundle.max_model_len == 40960  # model_max_length 131072 is larger, so it does not cap
    assert bundle.chat_template.startswith("{%- if tools %}")
    assert load_bundle(QWEN3_DIR, max_model_len=1000).max_model_len == 1000


TINY_RANKS = {**{bytes([b]): b for b in range(256)}, b"he": 256, b"ll": 257, b"hell": 258, b"hello": 259}


@pytest.fixture
def tiny_dir(tmp_path, cache) -> Path:
    """A small bundle with a tiny byte-level tokenizer: loads in milliseconds."""
    spec = byte_level_bpe_spec(TINY_RANKS, r" ?\p{L}+|\s+|.", normalizer={"type": "NFC"}, added_tokens=[
        {"id": 260, "content": "<eos>", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True},
        {"id": 261, "content": "<bos>", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True},
    ])
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
        "bos_token": {"content": "<bos>", "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True},
        "eos_token": "<eos>",
        "unk_token": None,
        "model_max_length": 1000000000000000019884624838656,
    }))
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 512, "eos_token_id": 260}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [260, 261]}))
    return tmp_path


def test_tiny_bundle_fields(tiny_dir):
    bundle = load_bundle(tiny_dir)
    assert bundle.tokenizer.encode("hello<eos>") == [259, 260]
    assert bundle.eos_token_ids == [260, 261]
    assert bundle.max_model_len == 512  # HF's 1e30 "no limit" model_max_length is ignored
    assert bundle.template_special_tokens == {"bos_token": "<bos>", "eos_token": "<eos>"}
    assert bundle.chat_template.startswith("{{ bos_token }}")
    assert bundle.tokenizer_sha256 == hashlib.sha256((tiny_dir / "tokenizer.json").read_bytes()).hexdigest()


def test_eos_falls_back_to_config_then_tokenizer_config(tiny_dir):
    (tiny_dir / "generation_config.json").unlink()
    assert load_bundle(tiny_dir).eos_token_ids == [260]
    (tiny_dir / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    assert load_bundle(tiny_dir).eos_token_ids == [260]  # from eos_token "<eos>"
    (tiny_dir / "tokenizer_config.json").write_text("{}")
    assert load_bundle(tiny_dir).eos_token_ids == []


def test_smaller_model_max_length_caps_the_context(tiny_dir):
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    config["model_max_length"] = 300
    (tiny_dir / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_bundle(tiny_dir).max_model_len == 300
    assert load_bundle(tiny_dir, max_model_len=2000).max_model_len == 2000


def test_context_length_without_any_config():
    assert derive_max_model_len({}, {}) == 2048
    assert derive_max_model_len({"n_positions": 1024, "max_position_embeddings": 4096}, {}) == 1024
    assert derive_max_model_len({"text_config": {"max_position_embeddings": 8192}}, {}) == 8192


@pytest.mark.parametrize("bad", [-1, 1.5, "4096", True])
def test_invalid_max_model_len_is_a_bundle_error(tiny_dir, bad):
    with pytest.raises(BundleError):
        load_bundle(tiny_dir, max_model_len=bad)


def test_chat_template_jinja_beside_wins(tiny_dir):
    (tiny_dir / "chat_template.jinja").write_text("FROM FILE {{ messages }}")
    assert load_bundle(tiny_dir).chat_template == "FROM FILE {{ messages }}"


def test_named_chat_templates(tiny_dir):
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    (tiny_dir / "tokenizer_config.json").write_text(json.dumps(config))
    bundle = load_bundle(tiny_dir)
    assert bundle.chat_template == "D"
    assert bundle.chat_templates == {"default": "D", "tool_use": "T"}


def test_chat_template_json_and_additional_templates(tiny_dir):
    (tiny_dir / "chat_template.json").write_text(json.dumps({"chat_template": "FROM JSON"}))
    (tiny_dir / "additional_chat_templates").mkdir()
    (tiny_dir / "additional_chat_templates" / "rag.jinja").write_text("RAG")
    bundle = load_bundle(tiny_dir)
    assert bundle.chat_template == "FROM JSON"
    assert bundle.chat_templates["rag"] == "RAG"


def test_a_bundle_without_optional_files_loads(tiny_dir):
    for name in ("tokenizer_config.json", "config.json", "generation_config.json"):
        (tiny_dir / name).unlink()
    bundle = load_bundle(tiny_dir)
    assert bundle.chat_template is None and bundle.eos_token_ids == [] and bundle.max_model_len == 2048


def test_missing_directory_or_tokenizer_is_a_bundle_error(tmp_path):
    with pytest.raises(BundleError, match="not a directory"):
        load_bundle(tmp_path / "missing")
    with pytest.raises(BundleError, match="no tokenizer.json"):
        load_bundle(tmp_path)


@pytest.mark.parametrize("name, content", [
    ("config.json", "{not json"),
    ("config.json", "[1, 2]"),
    ("tokenizer_config.json", '{"chat_template": 5}'),
    ("tokenizer_config.json", '{"chat_template": [{"name": "default"}]}'),
    ("generation_config.json", b"\xff\xfe"),
    ("tokenizer.json", '{"model": {"type": "BPE", "vocab": []}}'),
    ("tokenizer.json", ""),
])
def test_corrupt_files_are_bundle_errors(tiny_dir, name, content):
    path = tiny_dir / name
    path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    with pytest.raises(BundleError, match=name.split(".")[0]):
        load_bundle(tiny_dir)


def test_unwritable_cache_is_a_clear_build_error(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("SPLITSERVE_CACHE", str(blocker))
    with pytest.raises(BundleBuildError, match="SPLITSERVE_CACHE"):
        default_bundle_dir()


def test_builder_does_not_read_the_fixture():
    source = resources.files("render_service.bundle").joinpath("default_bundle.py").read_text(encoding="utf-8")
    assert "fixtures" not in source and not re.search(r"[\"']/(?:home|root|tmp|work|data)/", source)

