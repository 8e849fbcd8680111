"""The commands an operator runs against a live job start at once: `deltaps ctl` (the rollback switch) and
`deltaps top` import neither torch nor the codecs (~0.9 s of a core; the parser builds every command's flags)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _imported(*argv: str) -> set[str]:
    """Every module `python -X importtime -m deltaps ARGV` imported (its import-time log on stderr)."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "deltaps", *argv], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return {line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("argv", [("ctl", "--help"), ("top", "--help"), ("--help",)])
def test_operator_commands_start_without_torch(argv):
    mods = _imported(*argv)
    assert "deltaps.cli" in mods                      # the log was read
    heavy = sorted(m for m in mods if m.split(".")[0] in ("torch", "compression", "numpy"))
    assert not heavy, heavy[:10]


def test_the_advise_package_still_gives_its_names():
    from deltaps.tools import advise
    assert advise.DEFAULT_STRATEGIES[0] == "allreduce" and callable(advise.calibrate)
    assert all(getattr(advise, name) is not None for name in advise.__all__)     # every home in the map is right
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        getattr(advise, "nope")  # noqa: B009 (the lookup is what is tested)
