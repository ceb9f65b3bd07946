"""Fixtures of the laboratory's own tests (``python -m pytest dev/tests``; not part of the README's test command)."""

import json
import os
import random
import sys
import zlib

import pytest

SEED = int(os.environ.get("MLA_DISPATCH_SEED", random.SystemRandom().randrange(1 << 31)))


@pytest.fixture
def seed(request) -> int:
    """A per-test seed from the session seed (``MLA_DISPATCH_SEED`` replays it) and the test id."""
    return (SEED + zlib.crc32(request.node.nodeid.encode())) % (1 << 31)


@pytest.fixture
def chart_from_saved_run(tmp_path, monkeypatch):
    """``render(module, saved) -> png``: run a dev/ bench script's ``main`` (``module``, loaded from its file) as
    ``--from-json RUN --plot PNG`` on ``saved``, a run's JSON as the script writes it (no GPU), and return the PNG's
    path."""
    def render(module, saved: dict):
        src, png = tmp_path / "run.json", tmp_path / "run.png"
        src.write_text(json.dumps(saved))
        monkeypatch.setattr(sys, "argv", [f"{module.__name__}.py", "--from-json", str(src), "--plot", str(png)])
        module.main()
        return png

    return render
