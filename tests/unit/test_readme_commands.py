"""The README names only commands and options the CLI has, and every
setting is documented in docs/configuration.md (no farm needed)."""

from __future__ import annotations

import re

import pytest

from farm.app.cli import build_parser
from farm.core.settings import Settings
from tests import readme

CONFIGURATION = readme.ROOT / "docs" / "configuration.md"


def test_every_farm_command_in_the_readme_exists_with_its_options() -> None:
    commands = readme.farm_commands(readme.README.read_text())
    assert len(commands) > 30  # the quick start, everyday commands, the CLI summary
    parser = build_parser()
    problems = [p for c in commands for p in readme.check_command(parser, c)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("```bash\nfarm sumbit ./m.py:make\n```\n", "no command 'farm sumbit'"),
        ("```bash\nfarm submit ./m.py:make --nmae x\n```\n", "'farm submit' has no option --nmae"),
        ("```bash\nfarm alias sett m prod 1\n```\n", "no command 'farm alias sett'"),
        ("```bash\nexport A=1 && FARM_HOME=/x farm serv\n```\n", "no command 'farm serv'"),
        (
            "```text\nfarm jobs [--state S]   farm models --bogus\n```\n",
            "'farm models' has no option --bogus",
        ),
        ("see `farm resolve m --inptu x`\n", "'farm resolve' has no option --inptu"),
        ("```bash\nfarm submit m:make \\\n    --wiat\n```\n", "'farm submit' has no option --wiat"),
    ],
)
def test_a_wrong_command_or_option_is_found(text: str, problem: str) -> None:
    parser = build_parser()
    problems = [p for c in readme.farm_commands(text) for p in readme.check_command(parser, c)]
    assert any(problem in p for p in problems), problems


def test_heredocs_and_what_follows_farm_run_are_not_commands() -> None:
    text = (
        "```bash\ncat > a.py <<'PY'\nfarm nonsense --x\nPY\n"
        "farm run -- python train.py --epochs 3\n```\n"
    )
    commands = readme.farm_commands(text)
    assert [c.words[0] for c in commands] == ["run"]
    assert not readme.check_command(build_parser(), commands[0])


def test_every_setting_is_documented_in_configuration_md() -> None:
    text = CONFIGURATION.read_text()
    documented = set(re.findall(r"^\| `([A-Z0-9_]+)` \|", text, re.MULTILINE))
    missing = [name.upper() for name in Settings.model_fields if name.upper() not in documented]
    assert not missing, f"docs/configuration.md lacks a row for: {', '.join(missing)}"


def test_the_readme_is_a_guide_not_a_notebook() -> None:
    text = readme.README.read_text()
    # A guide one reads through: what is longer goes to docs/.
    assert len(text.splitlines()) <= 400
    assert not re.search(r"\bissue \d+|#\d{2,}\b", text), "issue numbers belong in the tracker"
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), "dated notes belong in docs/"
    assert "../" not in text, "paths outside the repository"


def test_the_readme_has_marked_blocks_to_run() -> None:
    marked = readme.marked_blocks(readme.README.read_text())
    assert any("farm submit" in b.text for b in marked)
    assert any(b.marker and b.marker.get("file") for b in marked)
    assert all(b.lang in ("bash", "python") for b in marked)
