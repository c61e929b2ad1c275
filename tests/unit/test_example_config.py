"""deploy/tramprof.example.toml is generated from the settings' declarations
in config.py (``tramprof config example``) and must match them."""

from __future__ import annotations

import tomllib
from dataclasses import fields
from pathlib import Path

import pytest
from tramprof.commands.cli import main
from tramprof.commands.config_example import example_toml, setting_blocks, toml_value
from tramprof.commands.run import RESTART_ONLY
from tramprof.config import Config, from_mapping

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "tramprof.example.toml"
REGENERATE = ".venv/bin/tramprof config example > deploy/tramprof.example.toml"


def test_example_file_is_the_generated_one() -> None:
    assert EXAMPLE.read_text(encoding="utf-8") == example_toml(), (
        f"{EXAMPLE.name} is out of date (a setting or its comment in config.py "
        f"changed): {REGENERATE}")


def test_config_example_command_prints_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "example"]) == 0
    assert capsys.readouterr().out == example_toml()


def test_example_sets_every_setting_to_its_default() -> None:
    data = tomllib.loads(example_toml())
    assert list(data) == [f.name for f in fields(Config)]
    assert from_mapping(data) == Config()


def test_every_setting_is_documented_in_config_py() -> None:
    """A comment right above each field, or above the field it is declared
    under, naming it."""
    blocks = setting_blocks()
    assert [n for b in blocks for n in b.names] == [f.name for f in fields(Config)]
    for block in blocks:
        first = block.names[0]
        assert block.comment, (f"{first}: add a comment above it in config.py saying what "
                               "it does, its range and its unit")
        text = " ".join(block.comment)
        for name in block.names[1:]:
            assert name in text, (f"{name} shares the comment of {first} in config.py, "
                                  "which does not name it")


def test_restart_only_settings_are_listed() -> None:
    header = example_toml().split("\n\n", 1)[0].replace("#", " ")
    listed = " ".join(header.split()).split("keeps their running values): ")[1]
    assert listed.split(". The others")[0].split(", ") == list(RESTART_ONLY)


def test_blocks_follow_comments_and_blank_lines() -> None:
    source = '''
class Example:
    # One.
    #   indented part
    a: int = 1
    b: int = 2  # shares a's comment

    c: int = 3
    # Three
    # lines.
    d: str = "x"

    def method(self) -> None:
        pass
'''
    blocks = setting_blocks(source, "Example")
    assert [(b.comment, b.names) for b in blocks] == [
        (("One.", "  indented part"), ("a", "b")),
        ((), ("c",)),  # after a blank line, with no comment: undocumented
        (("Three", "lines."), ("d",)),
    ]


@pytest.mark.parametrize("value", [
    0, -3, 1 << 40, 10.0, 0.1, 1e-05, 2.5e300, "", "plain", 'quote " and \\ backslash',
    "tab\tnew\nline\x00nul\x7fdel", "é …; ☃ \U0001f600", (), (1, 2, 3), ("comm", "pid"),
    True, False,
])
def test_toml_values_round_trip(value: object) -> None:
    parsed = tomllib.loads(f"key = {toml_value(value)}")["key"]
    expected = list(value) if isinstance(value, tuple) else value
    assert parsed == expected and type(parsed) is type(expected)


def test_toml_value_refuses_what_toml_cannot_hold() -> None:
    with pytest.raises(TypeError, match="no TOML form"):
        toml_value(None)
