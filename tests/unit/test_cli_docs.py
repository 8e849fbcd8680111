"""The docs stay true as the CLI grows: docs/cli.md documents every flag of every command, and README.md
stays a short front page (the two set-up commands first, links that resolve)."""
import re
from pathlib import Path

from helpers import walk_flags

from deltaps.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
README_PATH = ROOT / "README.md"
CLI_DOC = (ROOT / "docs" / "cli.md").read_text()


def _missing(parser, text, path=()):
    return sorted({f"{' '.join(p)} {o}" for p, o in walk_flags(parser, path)
                   if o not in text and not (o.startswith("--no-") and "--" + o[5:] in text)})


def test_every_flag_is_in_the_cli_reference():
    missing = _missing(build_parser(), CLI_DOC)
    assert not missing, f"flags missing from docs/cli.md: {missing}"


def test_every_bench_compare_flag_is_in_the_cli_reference():
    from deltaps.tools.bench_compare import build_parser as bench_compare_parser
    section = CLI_DOC[CLI_DOC.index("## `deltaps bench compare`"):]
    missing = _missing(bench_compare_parser(), section, ("bench", "compare"))
    assert not missing, f"flags missing from the bench compare section of docs/cli.md: {missing}"


def test_readme_is_a_short_front_page():
    text = README_PATH.read_text()
    lines = text.splitlines()
    assert len(lines) < 250, f"README.md has {len(lines)} lines; move details into docs/"
    body = [ln.strip() for ln in lines if ln.strip()]
    assert body[0].startswith("# "), "README.md starts with its title"
    assert body[1:5] == ["```", "make demo", "make test", "```"], \
        f"README.md must open with the make demo / make test block, got {body[1:5]}"
    links = re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", text)
    assert links, "README.md links to the docs"
    broken = []
    for link in links:
        if re.match(r"[a-z][a-z0-9+.-]*:", link) or link.startswith("#"):
            continue                      # URLs and in-page anchors
        target = (README_PATH.parent / link.split("#", 1)[0]).resolve()
        if not target.exists():
            broken.append(link)
    assert not broken, f"README.md links to missing files: {broken}"


def test_bad_flags_give_clear_errors(capsys):
    import pytest

    from deltaps.cli import main
    assert main(["launch", "--sync", "eventually", "--steps", "1"]) == 2
    assert "unknown sync mode" in capsys.readouterr().err
    assert main(["launch", "--codec", "zstd"]) == 2
    assert "unknown codec" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["worker", "--servers", "nohostport", "--rank", "0", "--world-size", "1"])


def test_every_workload_has_its_docs_line():
    from worker.workloads import available_workloads
    section = CLI_DOC[CLI_DOC.index("#### Workloads"):]
    section = section[:section.index("\n\n", section.index("- `"))]
    documented = re.findall(r"^- `([a-z0-9_]+)` — ", section, re.M)
    assert len(documented) == len(set(documented)) and set(documented) == set(available_workloads())
