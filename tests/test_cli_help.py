"""Every flag of every ``distca-hf`` subcommand says what it is (``--help``), units included."""

from __future__ import annotations

import argparse

import pytest


def _options(parser: argparse.ArgumentParser):
    """The parser's options and positionals, without ``-h/--help`` and the subcommand selector."""
    return [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]


def test_every_option_of_every_subcommand_has_help():
    from distca_hf.tools.cli import PASS_THROUGH, SUBCOMMANDS, parsers

    found = parsers()
    assert set(found) == {"distca-hf", "env", *SUBCOMMANDS} - set(PASS_THROUGH)
    missing = [f"distca-hf {name}: {'/'.join(action.option_strings) or action.dest}"
               for name, parser in found.items() for action in _options(parser)
               if not action.help or action.help == argparse.SUPPRESS or not action.help.strip()]
    assert not missing, f"options without a help text: {missing}"
    for name, parser in found.items():
        parser.format_help()  # every %(default)s and %% in the texts expands


def test_the_walk_sees_an_option_without_help():
    """The check above can fail: an option added without help is reported."""
    from distca_hf.tools.simulate import build_parser

    parser = build_parser()
    parser.add_argument("--undocumented", type=int)
    assert [a.dest for a in _options(parser) if not a.help] == ["undocumented"]


@pytest.mark.parametrize("flag, words", [
    ("--ranks", "ranks"), ("--tokens-per-rank", "tokens"), ("--batches", "batches"),
    ("--hidden", "elements per token (not bytes"), ("--bytes-per-s", "bytes per second"),
])
def test_simulate_help_names_the_units(flag, words, capsys):
    from distca_hf.tools.cli import main

    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    options = text[text.index("options:"):]
    assert words in options[options.index(flag + " "):][:300]
    assert "(bytes;" not in text


@pytest.mark.parametrize("command", [["env"], ["bench", "--world", "2"], ["kernel-bench"], ["profile"]])
def test_a_bad_distca_variable_stops_the_command_in_one_line(monkeypatch, capsys, command):
    """``env`` printed a traceback, ``bench`` spawned its workers and printed theirs; ``simulate`` reads
    no setting from the environment and still runs; ``--help`` still helps."""
    from distca_hf.tools.cli import main

    monkeypatch.setenv("DISTCA_TIMEOUT_S", "inf")
    with pytest.raises(SystemExit) as stopped:
        main(command)
    assert stopped.value.code == 2
    assert "distca-hf: error: invalid DISTCA_TIMEOUT_S='inf'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as helped:
        main([*command, "--help"])
    assert helped.value.code == 0
