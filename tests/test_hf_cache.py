"""A model id resolved from a Hugging Face cache laid out on disk (never the network): the hub's own layout
models--Org--Name/refs/<revision> -> snapshots/<commit>/, found through HF_HUB_CACHE or HF_HOME."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from splitserve_common.hf_cache import ModelNotFound, cached_snapshot, hub_cache_dir, resolve_model

MAIN = "a" * 40
V1 = "b" * 40


def lay_out_cache(hub: Path, repo_id: str = "Org/Tiny") -> Path:
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    for commit in (MAIN, V1):
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True)
        (snap / "config.json").write_text(f'{{"commit": "{commit}"}}')
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v1").write_text(V1 + "\n")
    return repo


def test_cache_dir_follows_hf_hub_cache_then_hf_home_then_xdg(tmp_path):
    assert hub_cache_dir({"HF_HUB_CACHE": str(tmp_path / "c"), "HF_HOME": "/x"}) == tmp_path / "c"
    assert hub_cache_dir({"HF_HOME": str(tmp_path / "home")}) == tmp_path / "home" / "hub"
    assert hub_cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "huggingface" / "hub"


def test_a_model_id_resolves_to_its_snapshot_per_revision(tmp_path):
    repo = lay_out_cache(tmp_path / "hub")
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    found = resolve_model("Org/Tiny", env=env)
    assert (found.directory, found.name, found.from_hub) == (str(repo / "snapshots" / MAIN), "Org/Tiny", True)
    assert resolve_model("Org/Tiny", "v1", env=env).directory == str(repo / "snapshots" / V1)
    assert resolve_model("Org/Tiny", V1, env=env).directory == str(repo / "snapshots" / V1)  # a commit directly
    env_home = {"HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    assert resolve_model("Org/Tiny", env=env_home).directory == str(repo / "snapshots" / MAIN)


def test_unknown_revisions_and_dangling_refs_are_not_in_the_cache(tmp_path):
    repo = lay_out_cache(tmp_path)
    assert cached_snapshot("Org/Tiny", "nope", tmp_path) is None
    assert cached_snapshot("Org/Tiny", "c" * 40, tmp_path) is None
    (repo / "refs" / "broken").write_text("not-a-commit")
    assert cached_snapshot("Org/Tiny", "broken", tmp_path) is None
    assert cached_snapshot("Org/Other", None, tmp_path) is None


def test_a_local_directory_wins_and_is_served_by_its_path(tmp_path):
    found = resolve_model(str(tmp_path), env={"HF_HUB_OFFLINE": "1"})
    assert (found.directory, found.from_hub) == (str(tmp_path), False)


@pytest.mark.parametrize("model, words", [
    ("/no/such/dir", "does not exist"),
    ("Org/Missing", "HF_HUB_OFFLINE"),
    ("../escape/x", "does not exist"),
])
def test_what_cannot_be_found_is_one_clear_line(tmp_path, model, words):
    with pytest.raises(ModelNotFound) as exc:
        resolve_model(model, env={"HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    assert words in str(exc.value) and "\n" not in str(exc.value)


def test_a_file_is_not_a_model(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFound, match="is a file"):
        resolve_model(str(tmp_path / "weights.bin"), env={"HF_HUB_OFFLINE": "1"})


def closed_endpoint() -> str:
    """A loopback URL nothing listens on: a download attempt fails at once and never leaves the machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_a_model_neither_cached_nor_downloadable_is_one_line(tmp_path):
    with pytest.raises(ModelNotFound) as exc:
        resolve_model("Org/Tiny", env={"HF_HUB_CACHE": str(tmp_path), "HF_ENDPOINT": closed_endpoint()})
    message = str(exc.value)
    assert "could not be downloaded" in message and str(tmp_path) in message and "\n" not in message


def test_a_snapshot_without_weights_serves_render_and_is_completed_for_the_engine(tmp_path):
    repo = lay_out_cache(tmp_path)  # config.json only, as the render tier fetches a repository
    env = {"HF_HUB_CACHE": str(tmp_path), "HF_ENDPOINT": closed_endpoint()}
    assert resolve_model("Org/Tiny", weights=False, env=env).directory == str(repo / "snapshots" / MAIN)
    # The engine asks the hub for the weights (unreachable here: huggingface_hub falls back to the snapshot);
    # offline it takes what is there, and then names what is missing ("no safetensors weights").
    assert resolve_model("Org/Tiny", weights=True, env=env).directory == str(repo / "snapshots" / MAIN)
    offline = {**env, "HF_HUB_OFFLINE": "1"}
    assert resolve_model("Org/Tiny", weights=True, env=offline).directory == str(repo / "snapshots" / MAIN)
    (repo / "snapshots" / MAIN / "model.safetensors").write_bytes(b"")
    assert resolve_model("Org/Tiny", weights=True, env=env).directory == str(repo / "snapshots" / MAIN)
