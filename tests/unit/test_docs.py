"""The docs that must follow the code: docs/config.md is generated from the pydantic models and must match
them (a field added, renamed or re-described without `python scripts/config_reference.py` fails here), and
docs/troubleshooting.md has a section for every diagnostic kind."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "config_reference.py"


def load_script():
    spec = importlib.util.spec_from_file_location("config_reference", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_config_reference_matches_the_models():
    script = load_script()
    assert script.DOC.read_text(encoding="utf-8") == script.render(), (
        "docs/config.md is out of date with src/asyncgrpo/config/: run `python scripts/config_reference.py` and commit it"
    )


def test_every_field_of_every_section_is_in_the_reference():
    from asyncgrpo.config import Config

    text = load_script().render()
    for section, model in Config.model_fields.items():
        for name in getattr(model.annotation, "model_fields", {}):
            assert f"`{section}.{name}`" in text or f"`{section}.{name}." in text


def test_troubleshooting_has_a_section_for_every_diagnostic_kind():
    from asyncgrpo.errors import DIAGNOSTIC_KINDS

    text = (SCRIPT.parent.parent / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    missing = [kind for kind in DIAGNOSTIC_KINDS if f"\n## {kind}\n" not in text]
    assert not missing, f"docs/troubleshooting.md has no section for {missing}"


def test_the_readme_states_the_tiny_models_alphabet():
    from asyncgrpo.models.tiny import ALPHABET

    readme = (SCRIPT.parent.parent / "README.md").read_text(encoding="utf-8")
    assert f"knows only {ALPHABET};" in " ".join(readme.split()), "README.md must state models/tiny.py ALPHABET"
