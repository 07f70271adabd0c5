"""The README's and the docs' runnable blocks, run as written in a clean folder, and the docs
site, built strict.

A block is runnable when the line before its fence is `<!-- run: KEY=VALUE ... -->`:
`timeout=S` (seconds), `creates=PATH,...` (files the block must leave), `again=refused` (a
second run in the same folder is refused at once, as documented). Shell blocks run in bash as
a user's terminal would (no -e), with `.venv` and `examples/` of this checkout in the folder and
`EDGEFCL_BROKER` on a free port; Python blocks run with this interpreter.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgefcl.transport.broker import free_port

REPO = Path(__file__).resolve().parents[1]
MARK = re.compile(r"<!-- run:(?P<attrs>[^>]*)-->\n```(?P<lang>\w*)\n(?P<code>.*?)\n```", re.S)
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def runnable_blocks() -> list[tuple[str, dict[str, str], str, str]]:
    """(where, attributes, language, code) of every marked block, each distinct code once."""
    seen: dict[str, tuple[str, dict[str, str], str, str]] = {}
    for page in PAGES:
        text = page.read_text()
        for m in MARK.finditer(text):
            attrs = dict(a.split("=", 1) for a in m.group("attrs").split())
            line = text[:m.start()].count("\n") + 2
            where = f"{page.relative_to(REPO)}:{line}"
            seen.setdefault(m.group("code"), (where, attrs, m.group("lang"), m.group("code")))
    return list(seen.values())


BLOCKS = runnable_blocks()


def run_block(lang: str, code: str, folder: Path, timeout: float) -> tuple[int, str, float]:
    """Run one block in `folder`: (exit code, stdout and stderr, seconds)."""
    env = os.environ | {"EDGEFCL_BROKER": f"mqtt://127.0.0.1:{free_port()}", "MPLBACKEND": "Agg",
                        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    cmd = [sys.executable, "-c", code] if lang == "python" else ["bash", "-c", code]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=folder, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out = "(timed out)"
    finally:
        with contextlib.suppress(ProcessLookupError):  # roles a failed block left running
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return proc.returncode, out, time.monotonic() - start


def test_the_blocks_are_found() -> None:
    wheres = " ".join(w for w, *_ in BLOCKS)
    assert "README.md" in wheres and "docs/guide/python-api.md" in wheres
    assert any("again" in attrs for _, attrs, _, _ in BLOCKS)  # the networked quick start


@pytest.mark.slow
@pytest.mark.mqtt
@pytest.mark.parametrize("where,attrs,lang,code", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_block_runs_as_written(where: str, attrs: dict[str, str], lang: str, code: str,
                               tmp_path: Path) -> None:
    (tmp_path / "examples").symlink_to(REPO / "examples")
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    timeout = float(attrs.get("timeout", 300))
    rc, out, _ = run_block(lang, code, tmp_path, timeout)
    tail = out[-3000:]
    assert "Traceback" not in out and "(timed out)" not in out, tail
    if lang == "python":
        assert rc == 0, tail
    for path in filter(None, attrs.get("creates", "").split(",")):
        assert (tmp_path / path).is_file(), f"{where} did not write {path}\n{tail}"
    if attrs.get("again") == "refused":
        rc, out, seconds = run_block(lang, code, tmp_path, timeout)
        assert "holds a finished run" in out and "--fresh" in out, out[-3000:]
        assert seconds < 60, f"the second run took {seconds:.0f} s to be refused"
        assert "Traceback" not in out, out[-3000:]


def test_the_docs_build_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                        "--site-dir", str(tmp_path / "site")], cwd=REPO, capture_output=True,
                       text=True, timeout=240, env=os.environ | {"NO_MKDOCS_2_WARNING": "1"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "api" / "index.html").is_file()


def test_the_layout_table_lists_every_root_module_and_folder() -> None:
    """docs/architecture.md's layout table stays true: every module at the package root and
    every folder of the package is a row (and no row names one that is gone)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    rows = set(re.findall(r"^\| `(edgefcl/[\w/.]+)` \|", text, re.M))
    pkg = REPO / "edgefcl"
    present = {f"edgefcl/{p.name}" for p in pkg.glob("*.py")} | {
        f"edgefcl/{p.name}/" for p in pkg.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rows == present
