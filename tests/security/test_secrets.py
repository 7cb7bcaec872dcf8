"""Secrets never land in a file hpctrain writes (run lock, config dump, provenance, logs,
metrics, tracking stores, job scripts) or in its messages.

A password is planted everywhere a user can put one: in a tracking URI of the config file or
of an override (refused at load, naming the environment variables to use instead, and
nothing written), in the environment (MLflow's credential variables, a token, an allow-listed
variable that holds a URI) and in the command line of a run; then every file under the run
directory and the generated scripts is searched for it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import DEMO, QUIET, REPO, TINY, run_cli
from hpctrain.cli import main

SECRET = "S3CRETpw42"
URIS = {"userinfo": f"https://alice:{SECRET}@mlflow.example:5000/",
        "query": f"https://mlflow.example:5000/?api_token={SECRET}"}
BASE = [*TINY, *QUIET, "parallel.strategy=none", "train.micro_batch=4", "data.source=stdlib"]


def _files_holding(root: Path, needle: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and needle.encode() in p.read_bytes()]


@pytest.mark.parametrize(("command", "where", "uri"), [
    ("train", "config", "userinfo"), ("train", "override", "userinfo"),
    ("train", "config", "query"), ("train", "override", "query"),
    ("sbatch", "override", "userinfo"), ("k8s", "config", "query")])
def test_credentials_in_a_tracking_uri_are_refused(tmp_path: Path, capsys, uri: str,
                                                   where: str, command: str) -> None:
    out = tmp_path / "out"
    config = tmp_path / "c.yaml"
    track = {"mlflow": True, **({"mlflow_uri": URIS[uri]} if where == "config" else {})}
    config.write_text(yaml.safe_dump({**yaml.safe_load((REPO / DEMO).read_text()),
                                      "track": track}))
    overrides = [f"run.out_dir={out}", *([f"track.mlflow_uri={URIS[uri]}"]
                                         if where == "override" else [])]
    extra = {"train": [],
             "sbatch": ["-o", str(out / "job.sh")],
             "k8s": ["--image", "img:1", "--runs-pvc", "runs", "-o", str(out / "job.yaml")]}
    with pytest.raises(SystemExit) as exit:
        main([command, str(config), *BASE, *overrides, *extra[command]])
    stdout, stderr = capsys.readouterr()
    assert exit.value.code == 2, stderr[-3000:]
    assert "holds a credential" in stderr and "MLFLOW_TRACKING_PASSWORD" in stderr
    assert "MLFLOW_TRACKING_TOKEN" in stderr
    assert SECRET not in stderr + stdout
    assert not out.exists() or not _files_holding(out, SECRET)


def test_a_run_records_no_secret(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """Secrets in the environment and in a failing command's words: nothing written has them."""
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "alice")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", SECRET)
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", SECRET)
    monkeypatch.setenv("HF_TOKEN", SECRET)
    # An allow-listed name (provenance records NCCL_*) whose value holds a URI with a password.
    monkeypatch.setenv("NCCL_HPCTRAIN_TEST_URL", URIS["userinfo"])
    out = tmp_path / "runs"
    args = ["train", DEMO, *BASE, "train.steps=2", f"run.out_dir={out}", "run.name=r",
            "track.mlflow=true", "checkpoint.every=2"]
    done = run_cli(args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "hpctrain.track" not in done.stderr, done.stderr[-3000:]  # MLflow did write
    run = out / "r"
    assert (run / "run.lock").exists() or (run / "provenance" / "provenance.json").exists()
    assert (run / "mlruns").is_dir() and (run / "provenance" / "provenance.json").is_file()
    assert "NCCL_HPCTRAIN_TEST_URL" in (run / "provenance" / "provenance.json").read_text()
    assert _files_holding(run, SECRET) == []
    assert SECRET not in done.stderr + done.stdout

    # A data path that is a URI with a password: refused, and the message does not repeat it.
    with pytest.raises(SystemExit) as exit:
        main(["train", str(REPO / DEMO), *BASE, f"run.out_dir={out}", "run.name=r2",
              "data.source=shards", f"data.path=https://alice:{SECRET}@data.example/corpus"])
    stdout, stderr = capsys.readouterr()
    assert exit.value.code == 2 and "<redacted>@data.example" in stderr, stderr[-3000:]
    assert SECRET not in stderr + stdout
    assert _files_holding(out, SECRET) == []

    # The job script of the same command, with the secrets still in the environment.
    script = tmp_path / "job.sh"
    main(["sbatch", str(REPO / DEMO), *BASE, f"run.out_dir={out}", "-o", str(script)])
    stdout, stderr = capsys.readouterr()
    assert SECRET not in script.read_text() + stderr + stdout
