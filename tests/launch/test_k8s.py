"""``hpctrain k8s``: every manifest validated against Kubernetes 1.37's own schemas
(kubernetes-validate, offline: its schemas ship inside the package; the network is cut during
validation to prove it), the JobSet's fields against the JobSet API, and the pods' shell run for
real on this machine: torchrun with 2 CPU ranks, SIGTERM to the shell as Kubernetes sends it,
a committed checkpoint and exit 75.

    .venv/bin/pytest tests/launch/test_k8s.py -q
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from hpctrain.cli import main
from hpctrain.errors import ConfigError
from hpctrain.launch.k8s import K8sJob, manifests, render
from hpctrain.observe.metrics import read_metrics

pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")
REPO = Path(__file__).resolve().parents[2]
K8S = "1.37"


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No network: any socket opened while validating fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("kubernetes-validate tried to open a socket")

    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def _generate(tmp: Path, capsys, *args: str) -> list[dict]:
    out = tmp / "job.yaml"
    main(["k8s", str(REPO / "configs" / "llama-1b.yaml"), "data.source=shards",
          "data.path=/workspace/data/corpus", "parallel.strategy=fsdp", "--image",
          "registry.example.com/hpctrain:0.1.0", "--runs-pvc", "hpctrain-runs", "--data-pvc",
          "corpus", "--nodes", "4", "--gpus-per-node", "8", "--cpus-per-node", "64",
          "--memory", "512Gi", "--namespace", "ml", "-o", str(out), *args])
    assert "kubectl apply -f" in capsys.readouterr().err
    return [d for d in yaml.safe_load_all(out.read_text()) if d]


def test_output_into_a_missing_folder_creates_it(tmp_path: Path, capsys) -> None:
    out = tmp_path / "runs" / "k8s" / "llama.yaml"
    main(["k8s", str(REPO / "configs" / "llama-1b.yaml"), "parallel.strategy=fsdp", "--image",
          "registry.example.com/hpctrain:0.1.0", "--runs-pvc", "hpctrain-runs", "--nodes", "4",
          "--gpus-per-node", "8", "-o", str(out)])
    assert f"wrote {out}" in capsys.readouterr().err
    assert any(d["kind"] == "Job" for d in yaml.safe_load_all(out.read_text()) if d)


def test_output_that_cannot_be_written_is_a_user_error(tmp_path: Path, capsys) -> None:
    (tmp_path / "taken").write_text("a file, not a folder")
    with pytest.raises(SystemExit) as exc:
        main(["k8s", str(REPO / "configs" / "demo.yaml"), "--image", "img:1", "--runs-pvc",
              "runs", "-o", str(tmp_path / "taken" / "job.yaml")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "cannot be written" in err and "Traceback" not in err, err


def _validate(obj: dict) -> None:
    kubernetes_validate.validate(obj, K8S, strict=True)


def test_indexed_job_service_and_config_validate(tmp_path: Path, capsys, offline) -> None:
    config, service, job = _generate(tmp_path, capsys)
    for obj in (config, service, job):
        _validate(obj)
    assert [o["kind"] for o in (config, service, job)] == ["ConfigMap", "Service", "Job"]
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == 4
    assert service["spec"]["clusterIP"] == "None" and spec["template"]["spec"]["subdomain"] == \
        service["metadata"]["name"] == "llama-1b"
    assert service["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    (pod,) = spec["template"]["spec"]["containers"]
    script = pod["command"][2]
    assert "--nnodes=4 --nproc-per-node=8" in script
    assert "--rdzv-backend=c10d --rdzv-endpoint=llama-1b-0.llama-1b:29400" in script
    assert pod["resources"]["limits"]["nvidia.com/gpu"] == 8
    rules = spec["podFailurePolicy"]["rules"]
    assert rules[0] == {"action": "Ignore", "onExitCodes": {
        "containerName": pod["name"], "operator": "In", "values": [75]}}
    # The config the pods read is the file plus its overrides.
    cfg = yaml.safe_load(config["data"]["config.yaml"])
    assert cfg["data"] == {"source": "shards", "seq_len": 2048, "max_bytes": 0,
                           "path": "/workspace/data/corpus"}
    mounts = {m["mountPath"]: m for m in pod["volumeMounts"]}
    assert mounts["/workspace/data"]["readOnly"] and "/workspace/runs" in mounts


def test_the_validator_catches_a_bad_manifest(tmp_path: Path, capsys, offline) -> None:
    *_, job = _generate(tmp_path, capsys)
    job["spec"]["completions"] = "four"
    with pytest.raises(kubernetes_validate.ValidationError, match="four"):
        _validate(job)
    job["spec"]["completions"] = 4
    job["spec"]["completionsMode"] = "Indexed"  # a typo: strict schemas refuse unknown fields
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(job)


def test_jobset_variant(tmp_path: Path, capsys, offline) -> None:
    config, jobset = _generate(tmp_path, capsys, "--variant", "jobset")
    _validate(config)
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and jobset["kind"] == "JobSet"
    spec = jobset["spec"]
    (rjob,) = spec["replicatedJobs"]
    # The Job inside is a batch/v1 Job spec: validate it as one.
    _validate({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"},
               "spec": rjob["template"]["spec"]})
    # JobSet API (v1alpha2): rules need a name and an action of its enum; pods are named
    # <jobset>-<replicatedJob>-<job index>-<pod index>.<subdomain>.
    (rule,) = spec["failurePolicy"]["rules"]
    assert rule["action"] in ("FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts")
    assert rule["name"] and rule["onJobFailureReasons"] == ["PodFailurePolicy"]
    assert spec["network"] == {"enableDNSHostnames": True, "subdomain": "llama-1b",
                               "publishNotReadyAddresses": True}
    script = rjob["template"]["spec"]["template"]["spec"]["containers"][0]["command"][2]
    assert f"--rdzv-endpoint=llama-1b-{rjob['name']}-0-0.llama-1b:29400" in script
    assert rjob["template"]["spec"]["podFailurePolicy"]["rules"][0]["action"] == "FailJob"


@pytest.mark.parametrize("args, message", [
    (["--name", "Llama_1B"], "cannot name the job's pods"),
    (["--name", "x" * 62], "cannot name the job's pods"),
    (["--memory", "lots"], "not a Kubernetes quantity"),
    (["parallel.tp=4", "--gpus-per-node", "6"], "would span nodes"),
])
def test_what_kubernetes_or_the_layout_would_refuse(tmp_path: Path, capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        _generate(tmp_path, capsys, *args)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and "Traceback" not in err, err


def test_sigterm_to_the_pod_checkpoints_and_exits_75(tmp_path: Path) -> None:
    """The pod's shell as Kubernetes runs it (rendezvous on this machine, 2 CPU ranks)."""
    tiny = ["run.device=cpu", "model.dim=64", "model.n_layers=2", "model.n_heads=4",
            "model.n_kv_heads=2", "model.ffn_dim=128", "data.seq_len=32",
            "data.max_bytes=200000", "train.micro_batch=2", "train.steps=1000",
            "metrics.log_every=1", "metrics.progress=false", "checkpoint.interval=none",
            "preempt.check_every=1", "parallel.strategy=ddp"]
    from hpctrain.launch.k8s import config_text

    job = K8sJob(name="tiny", image="unused", runs_pvc="runs", nodes=1, grace_s=60,
                 config_yaml=config_text(REPO / "configs" / "demo.yaml", tiny),
                 mount_dir=str(tmp_path / "ws"), config_dir=str(tmp_path / "etc"),
                 python=sys.executable)
    _, _, k8s_job = manifests(job)
    (pod,) = k8s_job["spec"]["template"]["spec"]["containers"]
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "config.yaml").write_text(job.config_yaml)
    script = pod["command"][2].replace("--rdzv-endpoint=tiny-0.tiny:29400",
                                       "--rdzv-endpoint=localhost:0")
    script = script.replace("--nproc-per-node=1", "--nproc-per-node=2")
    env = {**os.environ, **{e["name"]: e["value"] for e in pod["env"]}}
    proc = subprocess.Popen(["bash", "-c", script], cwd=tmp_path, env=env,
                            start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "ws" / "runs" / "tiny" / "metrics" / "rank-000.jsonl"
    try:
        deadline = time.monotonic() + 180
        while not (metrics.is_file() and sum("loss" in r for r in read_metrics(metrics)) >= 3):
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "no training steps in 180 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # what the kubelet does to PID 1
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    info = json.loads((tmp_path / "ws" / "runs" / "tiny" / "exit_info.json").read_text())
    assert proc.returncode == 75, out[-3000:]
    assert info["exit_code"] == 75 and "SIGTERM" in info["reason"], info
    assert (tmp_path / "ws" / "runs" / "tiny" / "checkpoints" / info["last_checkpoint"]).is_dir()


def test_names_and_render_without_the_cli() -> None:
    job = K8sJob(name="a", image="i", runs_pvc="r", config_yaml="run: {}\n", nodes=2)
    text = render(manifests(job))
    assert text.count("\n---\n") == 2 and "config.yaml: |\n" in text
    with pytest.raises(ConfigError):
        manifests(K8sJob(name="a", image="i", runs_pvc="R", config_yaml=""))
