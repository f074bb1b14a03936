"""The README's rules files are rules files: every YAML block of it that has
``rules:`` compiles as Sluice loads a file (its settings, overload's
included). A block naming a secret file on the reader's machine
(``/run/secrets/...``) is left out: that file is not here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tests.unit.conftest import ruleset_from

README = Path(__file__).resolve().parents[2] / "README.md"


def _is_rules_file(block: str) -> bool:
    """One YAML document with ``rules:`` (Kubernetes manifests hold several)."""
    documents = list(yaml.safe_load_all(block))
    return len(documents) == 1 and isinstance(documents[0], dict) and "rules" in documents[0]


BLOCKS = [block for block in re.findall(r"```yaml\n(.*?)```", README.read_text(), re.S)
          if _is_rules_file(block) and "secret_file:" not in block]


def test_the_readme_has_rules_files() -> None:
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block-{n}" for n in range(len(BLOCKS))])
def test_every_rules_file_in_the_readme_compiles(block: str) -> None:
    ruleset_from(block)
