"""The README documents every CLI flag of every command (keeps the README true as flags are added)."""
import argparse
from pathlib import Path

from deltaps.cli import build_parser

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def _walk(parser, path=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, path + (name,))
        else:
            for opt in action.option_strings:
                if opt.startswith("--") and opt != "--help":
                    yield path, opt


def test_every_flag_is_in_the_readme():
    missing = sorted({f"{' '.join(p)} {o}" for p, o in _walk(build_parser())
                      if o not in README and not (o.startswith("--no-") and "--" + o[5:] in README)})
    assert not missing, f"flags missing from README.md: {missing}"


def test_bad_flags_give_clear_errors(capsys):
    import pytest

    from deltaps.cli import main
    assert main(["launch", "--sync", "eventually", "--steps", "1"]) == 2
    assert "unknown sync mode" in capsys.readouterr().err
    assert main(["launch", "--codec", "zstd"]) == 2
    assert "unknown codec" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["worker", "--servers", "nohostport", "--rank", "0", "--world-size", "1"])
