"""Hostile and broken input trees for `data prepare`, `data pack` and `data train-tokenizer`.

A link out of the tree (``corpus/x.txt -> /etc/shadow``) must not end up in shards; FIFOs,
sockets and devices are never opened; unreadable directories and files, dangling links and an
``--out`` that is a file are exit 2 with a message. Unreadable paths are tested for real: the
suite runs as root, for whom ``chmod 000`` changes nothing, so those commands run with
CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH dropped (``setpriv``), which makes the permission bits
apply to root as the owner.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli
from hpctrain.data.inputs import expand_inputs
from hpctrain.data.prepare import PrepareSettings, prepare
from hpctrain.data.shards import load_manifest
from hpctrain.data.tar_samples import pack
from hpctrain.data.tokenizer import TokenizerSpec
from hpctrain.errors import DataError

REPO = Path(__file__).resolve().parents[2]
BYTES = PrepareSettings(TokenizerSpec(), shard_tokens=1000)
SECRET = b"root:$6$not-for-shards$hash:19000:0:99999:7:::\n"
# A command that would block forever on a FIFO must not hang the suite.
TIMEOUT_S = 120
HAVE_TOKENIZERS = importlib.util.find_spec("tokenizers") is not None


def _corpus(tmp_path: Path) -> tuple[Path, Path]:
    """``corpus/`` with two documents and a link to a secret file outside it."""
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_bytes(b"alpha\n")
    (corpus / "sub" / "b.txt").write_bytes(b"beta\n")
    secret = tmp_path / "outside" / "shadow"
    secret.parent.mkdir()
    secret.write_bytes(SECRET)
    (corpus / "shadow.txt").symlink_to(secret)
    return corpus, secret


def _all_tokens(out: Path) -> bytes:
    m = load_manifest(out)
    return b"".join(np.asarray(m.tokens(i)).astype(np.uint8).tobytes()
                    for i in range(len(m.shards)))


def _tar_bytes(out: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(out.glob("shard-*.tar")))


def _data(*args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``hpctrain data ARGS`` in a process of its own, killed after TIMEOUT_S: forked (conftest's
    run_cli) unless ``prefix`` (e.g. another user's) must start it."""
    if not prefix:
        return run_cli(["data", *args], timeout=TIMEOUT_S)
    return subprocess.run([*prefix, sys.executable, "-m", "hpctrain", "data", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.fixture
def data_here(capsys: pytest.CaptureFixture):
    """``hpctrain data ARGS`` in this process (``cli.main``), as a CompletedProcess whose
    stderr holds what the command printed there and the warnings it logged (which the console
    shows: see the subprocess run in the first CLI test). For inputs that cannot block: the
    FIFO test runs in a subprocess, which a timeout can end."""
    from hpctrain.cli import main

    def run(*args: str) -> subprocess.CompletedProcess:
        # On the `hpctrain` logger itself: a test that set up rank logging in this process
        # may have stopped it propagating to pytest's handlers.
        warnings = _Collect(logging.WARNING)
        logger = logging.getLogger("hpctrain")
        logger.addHandler(warnings)
        try:
            main(["data", *args])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        finally:
            logger.removeHandler(warnings)
        out = capsys.readouterr()
        logged = "".join(f"{message}\n" for message in warnings.messages)
        return subprocess.CompletedProcess(["data", *args], code, out.out, out.err + logged)

    return run


class _Collect(logging.Handler):
    """Keeps the messages of the records it is handed."""

    def __init__(self, level: int):
        super().__init__(level)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


# -- links out of the tree ---------------------------------------------------------------------


def test_prepare_skips_a_link_out_of_the_tree(tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    corpus, _ = _corpus(tmp_path)
    for n, inputs in enumerate(([corpus], [str(corpus / "*.txt"), str(corpus / "sub")])):
        caplog.clear()
        with caplog.at_level(logging.WARNING, "hpctrain.data"):
            prepare(inputs, tmp_path / f"out{n}", BYTES)
        assert SECRET.strip() not in _all_tokens(tmp_path / f"out{n}")
        assert _all_tokens(tmp_path / f"out{n}").count(b"alpha") == 1
        assert "shadow.txt" in caplog.text and "--follow-symlinks" in caplog.text
        # The manifest does not even name it.
        assert "shadow" not in json.dumps(load_manifest(tmp_path / f"out{n}").raw["inputs"])


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_cli_prepare_pack_and_tokenizer_skip_it_unless_asked(tmp_path: Path,
                                                             data_here) -> None:
    corpus, _ = _corpus(tmp_path)
    # A real process once: the warning reaches the console.
    r = _data("prepare", str(corpus), "--out", str(tmp_path / "p"), "--workers", "1",
              "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "shadow.txt" in r.stderr and SECRET.strip() not in _all_tokens(tmp_path / "p")
    r = data_here("prepare", str(corpus), "--out", str(tmp_path / "pf"), "--workers", "1",
                  "--no-progress", "--follow-symlinks")
    assert r.returncode == 0, r.stderr
    assert SECRET.strip() in _all_tokens(tmp_path / "pf")

    r = data_here("pack", str(corpus), "--out", str(tmp_path / "k"))
    assert r.returncode == 0, r.stderr
    assert "shadow.txt" in r.stderr and SECRET.strip() not in _tar_bytes(tmp_path / "k")
    r = data_here("pack", str(corpus), "--out", str(tmp_path / "kf"), "--follow-symlinks")
    assert r.returncode == 0, r.stderr
    assert SECRET.strip() in _tar_bytes(tmp_path / "kf")

    if HAVE_TOKENIZERS:
        r = data_here("train-tokenizer", str(corpus), "--vocab", "260", "--out",
                      str(tmp_path / "tok.json"))
        assert r.returncode == 0, r.stderr
        assert "shadow.txt" in r.stderr


def test_a_directory_link_out_of_the_tree_is_skipped(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    corpus, secret = _corpus(tmp_path)
    (corpus / "shadow.txt").unlink()
    (corpus / "etc").symlink_to(secret.parent, target_is_directory=True)
    (secret.parent / "shadow.txt").write_bytes(SECRET)
    with caplog.at_level(logging.WARNING, "hpctrain.data"):
        files = expand_inputs([str(corpus)])
    assert sorted(f.path.name for f in files) == ["a.txt", "b.txt"]
    assert "etc" in caplog.text
    # A glob that walks through the link is held to the same rule.
    with caplog.at_level(logging.WARNING, "hpctrain.data"):
        files = expand_inputs([str(corpus / "**" / "*.txt")])
    assert sorted(f.path.name for f in files) == ["a.txt", "b.txt"]


# -- links inside the tree ---------------------------------------------------------------------


def test_links_inside_the_tree_read_each_file_once_and_loops_end(tmp_path: Path) -> None:
    corpus, _ = _corpus(tmp_path)
    (corpus / "shadow.txt").unlink()
    (corpus / "alias.txt").symlink_to(corpus / "a.txt")  # the same file twice
    (corpus / "sub" / "loop").symlink_to(corpus, target_is_directory=True)  # a cycle
    (corpus / "again").symlink_to(corpus / "sub", target_is_directory=True)
    prepare([corpus], tmp_path / "out", BYTES)
    tokens = _all_tokens(tmp_path / "out")
    assert tokens.count(b"alpha") == 1 and tokens.count(b"beta") == 1
    # The copies reached only through links are left out; the real paths are recorded.
    paths = [Path(r["path"]).relative_to(corpus).as_posix()
             for r in load_manifest(tmp_path / "out").raw["inputs"]]
    assert paths == ["a.txt", "sub/b.txt"]
    pack(corpus, tmp_path / "packed")
    with tarfile.open(tmp_path / "packed" / "shard-000000.tar") as tar:
        names = tar.getnames()
    # pack keeps a file link as its own sample (x.json -> y.json is a common way to share a
    # field), but never walks a directory twice.
    assert names == ["a.txt", "alias.txt", "sub/b.txt"]


# -- special files -----------------------------------------------------------------------------


def test_fifos_sockets_and_devices_are_never_opened(tmp_path: Path) -> None:
    corpus, _ = _corpus(tmp_path)
    (corpus / "shadow.txt").unlink()
    os.mkfifo(corpus / "pipe.txt")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(corpus / "sock.txt"))
    (corpus / "zero.txt").symlink_to("/dev/zero")  # endless if it were read
    try:
        for cmd in (["prepare", str(corpus), "--out", str(tmp_path / "p"), "--workers", "1",
                     "--no-progress", "--follow-symlinks"],
                    ["pack", str(corpus), "--out", str(tmp_path / "k"), "--follow-symlinks"]):
            r = _data(*cmd)
            assert r.returncode == 0, r.stderr
            for name in ("pipe.txt", "sock.txt", "zero.txt"):
                assert name in r.stderr, (name, r.stderr)
        assert _all_tokens(tmp_path / "p") == b"alpha\n\x00beta\n\x00"
        # Named explicitly, a FIFO is refused rather than silently left out.
        r = _data("prepare", str(corpus / "pipe.txt"), "--out", str(tmp_path / "q"))
        assert r.returncode == 2 and "pipe.txt" in r.stderr and "FIFO" in r.stderr, r.stderr
    finally:
        sock.close()


# -- broken inputs and outputs: exit 2, a message, no traceback --------------------------------


def _assert_exit_2(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode == 2, r.stderr
    assert "\nhpctrain: error: " in "\n" + r.stderr and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in r.stderr, (w, r.stderr)


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
def test_dangling_link_and_out_that_is_a_file(tmp_path: Path, data_here) -> None:
    corpus, _ = _corpus(tmp_path)
    (corpus / "gone.txt").symlink_to(corpus / "deleted.txt")
    _assert_exit_2(data_here("prepare", str(corpus), "--out", str(tmp_path / "p")),
                   "gone.txt", "dangling")
    _assert_exit_2(data_here("pack", str(corpus), "--out", str(tmp_path / "k")), "gone.txt",
                   "dangling")
    (corpus / "gone.txt").unlink()
    (tmp_path / "file").write_text("precious")
    _assert_exit_2(data_here("prepare", str(corpus), "--out", str(tmp_path / "file")),
                   str(tmp_path / "file"), "not a directory")
    _assert_exit_2(data_here("pack", str(corpus), "--out", str(tmp_path / "file")),
                   str(tmp_path / "file"), "not a directory")
    assert (tmp_path / "file").read_text() == "precious"
    if HAVE_TOKENIZERS:
        (tmp_path / "dir").mkdir()
        _assert_exit_2(data_here("train-tokenizer", str(corpus), "--vocab", "260", "--out",
                                 str(tmp_path / "dir")), str(tmp_path / "dir"),
                       "is a directory")


def _without_root_privilege() -> tuple[str, ...]:
    """A command prefix under which permission bits apply (root loses its DAC override)."""
    if os.geteuid() != 0:
        return ()
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: cannot make a file unreadable to root")
    prefix = (setpriv, "--bounding-set=-dac_override,-dac_read_search")
    if subprocess.run([*prefix, "true"], capture_output=True).returncode != 0:
        pytest.skip("setpriv cannot drop CAP_DAC_OVERRIDE here (no CAP_SETPCAP)")
    return prefix


def test_unreadable_directory_and_file_are_errors(tmp_path: Path) -> None:
    prefix = _without_root_privilege()
    corpus, _ = _corpus(tmp_path)
    (corpus / "shadow.txt").unlink()
    locked = corpus / "locked"
    locked.mkdir()
    (locked / "c.txt").write_text("gamma")
    locked.chmod(0)
    try:
        for cmd in (["prepare", str(corpus), "--out", str(tmp_path / "p"), "--workers", "1"],
                    ["pack", str(corpus), "--out", str(tmp_path / "k")]):
            _assert_exit_2(_data(*cmd, prefix=prefix), str(locked))
    finally:
        locked.chmod(0o755)
    secret = corpus / "sub" / "b.txt"
    secret.chmod(0)
    for cmd in (["prepare", str(corpus), "--out", str(tmp_path / "p"), "--workers", "1"],
                ["prepare", str(secret), "--out", str(tmp_path / "p1"), "--workers", "1"],
                ["pack", str(corpus), "--out", str(tmp_path / "k")]):
        _assert_exit_2(_data(*cmd, prefix=prefix), str(secret), "ermission denied")
    if HAVE_TOKENIZERS:
        _assert_exit_2(_data("train-tokenizer", str(corpus), "--vocab", "260", "--out",
                             str(tmp_path / "t.json"), prefix=prefix), str(secret))


# -- the file that is opened is the file that was vetted ---------------------------------------


def test_a_file_swapped_after_discovery_is_refused(tmp_path: Path) -> None:
    corpus, secret = _corpus(tmp_path)
    (corpus / "shadow.txt").unlink()
    files = expand_inputs([str(corpus)])
    victim = next(f for f in files if f.path.name == "a.txt")
    with victim.open() as fh:
        assert fh.read() == b"alpha\n"
    # Swapped for a link out of the tree, a FIFO, or another file (a hard link to it), between
    # listing and reading. (A new file written in its place may reuse the inode number; that is
    # no escape from the tree, whoever can write the tree can write that content anyway.)
    for swap in (lambda p: p.symlink_to(secret), lambda p: os.mkfifo(p),
                 lambda p: os.link(secret, p)):
        (corpus / "a.txt").unlink()
        swap(corpus / "a.txt")
        with pytest.raises(DataError, match="a.txt"), victim.open() as fh:
            fh.read()
