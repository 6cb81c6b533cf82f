"""The optimised encoder: OpenVINO from a cached export of the packaged weights, torch as fallback."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from memory.config import default_embedding_model, get_settings
from memory.recall import encoder_cache
from memory.recall.embeddings import SentenceTransformerEmbedder, configured_embedder

TEXTS = [
    "My sister moved to Porto last spring.",
    "What car do I drive?",
    "Ich arbeite als Krankenpfleger im St. Marien Krankenhaus.",
    "We talked about the trip to Kyoto for a long time: " + "temples, trains and food. " * 40,
]


def cache_root() -> Path:
    return Path(os.environ["EMBEDDING_CACHE_DIR"])


@pytest.fixture(scope="module")
def torch_model() -> SentenceTransformerEmbedder:
    model = SentenceTransformerEmbedder(default_embedding_model(), runtime="torch")
    model.load(threads=1)
    return model


@pytest.fixture(scope="module")
def openvino_model() -> SentenceTransformerEmbedder:
    model = SentenceTransformerEmbedder(
        default_embedding_model(), runtime="openvino", cache_root=cache_root()
    )
    model.load(threads=1)
    return model


def test_openvino_is_the_default_and_gives_torchs_vectors(
    openvino_model: SentenceTransformerEmbedder, torch_model: SentenceTransformerEmbedder
) -> None:
    assert get_settings().embedding_runtime == "openvino"
    assert openvino_model.runtime == "openvino" and openvino_model.fallback_reason is None
    fast = openvino_model.encode_sync(TEXTS)
    slow = torch_model.encode_sync(TEXTS)
    for a, b in zip(fast, slow, strict=True):
        assert sum(x * y for x, y in zip(a, b, strict=True)) > 0.9999
    # The two runtimes are recorded as different makers of vectors (index provenance).
    assert openvino_model.spec["runtime"] == "openvino" and torch_model.spec["runtime"] == "torch"
    assert torch_model.spec["source_sha256"] == encoder_cache.PACKAGED_WEIGHTS_SHA256
    assert openvino_model.spec["source_sha256"] == encoder_cache.PACKAGED_WEIGHTS_SHA256
    assert openvino_model.spec["graph_sha256"] not in (None, encoder_cache.PACKAGED_WEIGHTS_SHA256)


def test_the_export_is_cached_and_a_damaged_one_is_not_used(
    openvino_model: SentenceTransformerEmbedder,
) -> None:
    model_path = Path(default_embedding_model())
    folder, graph_sha = encoder_cache.openvino_export(model_path, cache_root())
    manifest = json.loads((folder / encoder_cache.MANIFEST).read_text())
    assert manifest["source_sha256"] == encoder_cache.PACKAGED_WEIGHTS_SHA256
    assert graph_sha == openvino_model.spec["graph_sha256"]
    assert not (folder / encoder_cache.WEIGHTS_FILE).exists()  # the graph carries its own weights
    # A second call finds the export (no new files, same manifest).
    assert encoder_cache.openvino_export(model_path, cache_root()) == (folder, graph_sha)
    source_sha = manifest["source_sha256"]
    assert encoder_cache._manifest_ok(folder, source_sha)
    assert not encoder_cache._manifest_ok(folder, "0" * 64)  # other weights: another export


def test_a_damaged_export_is_detected(tmp_path: Path) -> None:
    folder = tmp_path / "x-openvino"
    (folder / "openvino").mkdir(parents=True)
    graph = folder / "openvino" / "openvino_model.bin"
    graph.write_bytes(b"weights")
    files = {"openvino/openvino_model.bin": {"size": 7, "sha256": encoder_cache.file_sha256(graph)}}
    manifest = {"source_sha256": "s", "versions": encoder_cache.export_versions(), "files": files}
    (folder / encoder_cache.MANIFEST).write_text(json.dumps(manifest))
    assert encoder_cache._manifest_ok(folder, "s")
    graph.write_bytes(b"weighTs")  # same size, other content
    assert not encoder_cache._manifest_ok(folder, "s")
    manifest["versions"] = {**manifest["versions"], "openvino": "0"}  # made by another OpenVINO
    graph.write_bytes(b"weights")
    (folder / encoder_cache.MANIFEST).write_text(json.dumps(manifest))
    assert not encoder_cache._manifest_ok(folder, "s")


def test_without_openvino_the_encoder_falls_back_to_torch_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def unavailable(*args: object) -> None:
        raise ImportError("No module named 'openvino'")

    monkeypatch.setattr(encoder_cache, "openvino_export", unavailable)
    settings = get_settings(data_dir=tmp_path, embedding_cache_dir=None)
    model = configured_embedder(settings)
    assert model.cache_root == tmp_path / "encoders" and model.requested_runtime == "openvino"
    with caplog.at_level(logging.WARNING):
        model.load(threads=1)
    assert model.runtime == "torch" and "openvino" in (model.fallback_reason or "")
    assert any("encoding with torch" in r.getMessage() for r in caplog.records)
    assert len(model.encode_sync(["a fact"])[0]) == 384
    # Its twin (the in-process indexer's copy) does not try OpenVINO again.
    assert model.twin().runtime == "torch"


def test_loading_the_encoder_prints_no_library_chatter(capfd: pytest.CaptureFixture[str]) -> None:
    """A start printed optimum's "could not infer whether the model was already converted …
    expected str, bytes or os.PathLike object, not NoneType" and transformers' load report:
    noise an operator reads as a fault. Their warnings are dropped while loading, then restored.
    """
    from transformers.utils import logging as transformers_logging

    verbosity = transformers_logging.get_verbosity()
    for runtime in ("openvino", "torch"):
        model = SentenceTransformerEmbedder(
            default_embedding_model(), runtime=runtime, cache_root=cache_root()
        )
        model.load(threads=1)
        assert model.runtime == runtime
    printed = capfd.readouterr()
    chatter = printed.err + printed.out
    assert "Could not infer" not in chatter and "LOAD REPORT" not in chatter
    assert "PathLike" not in chatter and "Loading weights" not in chatter
    assert transformers_logging.get_verbosity() == verbosity
    assert transformers_logging.is_progress_bar_enabled()
