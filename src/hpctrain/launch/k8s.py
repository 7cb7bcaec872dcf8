"""``hpctrain k8s``: Kubernetes manifests for a multi-node training job.

    hpctrain k8s configs/llama-1b.yaml data.source=shards data.path=/workspace/data/corpus \\
        --image registry.example.com/hpctrain:0.1.0 --nodes 4 --gpus-per-node 8 \\
        --runs-pvc hpctrain-runs --data-pvc corpus -o llama.yaml
    kubectl apply -f llama.yaml
    hpctrain k8s ... --variant jobset      # a JobSet (jobset.x-k8s.io/v1alpha2) instead

What comes out (one YAML stream):

- a ConfigMap with the config and its overrides, mounted at /etc/hpctrain/config.yaml; for a
  task file (``hpctrain k8s my_task.py``) the file too, as /etc/hpctrain/task.py, which the
  config names (modules it imports must be in the image);
- ``indexed`` (default): a headless Service and an Indexed Job of ``--nodes`` pods; pod ``i``
  is ``<name>-<i>.<name>``, and pod 0 hosts torchrun's c10d rendezvous;
- ``jobset``: a JobSet of one replicated Job (pods ``<name>-node-0-<i>.<name>``; JobSet makes
  the headless Service); any failure restarts every pod, a preemption without spending
  ``--max-restarts``.

Each pod runs ``torchrun`` with one process per GPU (one on a CPU node) and mounts the runs
volume (``--runs-pvc``, ReadWriteMany: every pod writes its ranks' checkpoint shards there) at
``<mount>/runs``, the data volume read-only at ``<mount>/data`` and a memory-backed /dev/shm.
The run is ``<mount>/runs/<name>`` (run.suffix=none), so a replaced pod resumes it.

Preemption keeps the save-and-exit-75 protocol: Kubernetes sends SIGTERM to the pod (eviction,
node drain) and waits ``terminationGracePeriodSeconds``; the pod's shell forwards it to
torchrun, torchrun to the ranks, the ranks agree, commit a checkpoint and exit 75. torchrun
itself exits 1 after a signal, so the shell exits 75 when the run's exit_info.json, written
during this attempt, says 75. The Job's podFailurePolicy ignores exit 75 and evictions (the pod
is replaced and resumes; nothing counts against the backoff limit); the JobSet's fails the Job
on 75 and restarts the set without counting it.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from hpctrain.errors import ConfigError
from hpctrain.runtime.exit_codes import PREEMPTED

CONFIG_DIR = "/etc/hpctrain"
# A task file's name in the ConfigMap (and in CONFIG_DIR of the pods).
TASK_FILE = "task.py"
CONTAINER = "trainer"
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?")
Variant = Literal["indexed", "jobset"]


@dataclass
class K8sJob:
    """The training job as Kubernetes will run it."""

    name: str
    image: str
    runs_pvc: str
    config_yaml: str
    nodes: int = 1
    gpus_per_node: int = 0
    cpus_per_node: str | None = None
    memory: str | None = None
    namespace: str | None = None
    data_pvc: str | None = None
    mount_dir: str = "/workspace"
    port: int = 29400
    grace_s: int = 180
    max_restarts: int = 3
    python: str = "python3"
    config_dir: str = CONFIG_DIR
    labels: dict[str, str] = field(default_factory=dict)
    # A task file's text: in the ConfigMap beside the config, as TASK_FILE.
    task_py: str | None = None

    @property
    def procs_per_node(self) -> int:
        """Processes each pod starts: one per GPU, one on a CPU node."""
        return self.gpus_per_node or 1

    def validate(self, variant: Variant) -> None:
        """Names Kubernetes accepts, positive sizes, quantities it can parse."""
        # Pod hostnames carry the name and an index, and must fit a 63-character DNS label.
        suffix = f"-node-0-{self.nodes - 1}" if variant == "jobset" else f"-{self.nodes - 1}"
        if not _DNS_LABEL.fullmatch(self.name) or len(self.name + suffix) > 63:
            raise ConfigError(f"--name {self.name!r} cannot name the job's pods",
                              expected=f"lower-case letters, digits and '-', at most "
                              f"{63 - len(suffix)} characters",
                              hint="pass --name, e.g. --name llama-1b")
        for key in ("runs_pvc", "data_pvc", "namespace"):
            value = getattr(self, key)
            if value is not None and not _DNS_LABEL.fullmatch(value):
                raise ConfigError(f"--{key.replace('_', '-')} {value!r} is not a Kubernetes name",
                                  expected="lower-case letters, digits and '-'")
        for key in ("nodes", "grace_s", "port"):
            if getattr(self, key) < 1:
                raise ConfigError(f"--{key.replace('_', '-')} must be >= 1")
        if self.gpus_per_node < 0 or self.max_restarts < 0:
            raise ConfigError("--gpus-per-node and --max-restarts must be >= 0")
        for key in ("cpus_per_node", "memory"):
            value = getattr(self, key)
            if value is not None and not _QUANTITY.fullmatch(value):
                raise ConfigError(f"--{key.replace('_', '-')} {value!r} is not a Kubernetes "
                                  "quantity", expected="e.g. 32, 500m, 256Gi")
        if not self.mount_dir.startswith("/"):
            raise ConfigError(f"--mount-dir {self.mount_dir!r} must be an absolute path")

    @property
    def run_dir(self) -> str:
        """The run directory inside the pods."""
        return f"{self.mount_dir}/runs/{self.name}"


def endpoint(job: K8sJob, variant: Variant) -> str:
    """Where pod 0's torchrun agent hosts the c10d rendezvous."""
    host = f"{job.name}-node-0-0" if variant == "jobset" else f"{job.name}-0"
    return f"{host}.{job.name}:{job.port}"


def pod_script(job: K8sJob, variant: Variant) -> str:
    """The pod's shell: torchrun in the background, SIGTERM forwarded, exit 75 restored."""
    torchrun = [
        job.python, "-m", "torch.distributed.run", f"--nnodes={job.nodes}",
        f"--nproc-per-node={job.procs_per_node}", "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint(job, variant)}", f"--rdzv-id={job.name}",
        "--max-restarts=0", "-m", "hpctrain", "train", f"{job.config_dir}/config.yaml",
        f"run.out_dir={job.mount_dir}/runs", f"run.name={job.name}", "run.suffix=none"]
    info = shlex.quote(f"{job.run_dir}/exit_info.json")
    return "\n".join([
        "set -u",
        "started=$(mktemp)",
        "# Kubernetes signals PID 1 (this shell), which passes it on to torchrun, which passes",
        "# it on to the ranks: they checkpoint and exit 75.",
        'trap \'kill -TERM "$pid" 2>/dev/null\' TERM INT',
        " ".join(shlex.quote(a) for a in torchrun) + " &",
        "pid=$!",
        "rc=0",
        'wait "$pid" || rc=$?',
        '# A trapped signal ends `wait` early: wait again for torchrun\'s own exit code.',
        'while kill -0 "$pid" 2>/dev/null; do rc=0; wait "$pid" || rc=$?; done',
        f"# torchrun exits 1 after a signal even when its ranks committed a checkpoint and "
        f"exited {PREEMPTED}:",
        "# the run's exit_info.json, written during this attempt, says which.",
        f'if [ "$rc" -ne 0 ] && [ {info} -nt "$started" ] && '
        f"grep -q '\"exit_code\": {PREEMPTED},' {info}; then",
        f"    rc={PREEMPTED}",
        "fi",
        'exit "$rc"',
        ""])


def _pod_spec(job: K8sJob, variant: Variant) -> dict[str, Any]:
    resources: dict[str, dict[str, Any]] = {"requests": {}, "limits": {}}
    if job.gpus_per_node:
        resources["limits"]["nvidia.com/gpu"] = job.gpus_per_node
        resources["requests"]["nvidia.com/gpu"] = job.gpus_per_node
    for key, value in (("cpu", job.cpus_per_node), ("memory", job.memory)):
        if value is not None:
            resources["requests"][key] = value
            resources["limits"][key] = value
    cpus = int(job.cpus_per_node) if job.cpus_per_node and job.cpus_per_node.isdigit() else 0
    env = [{"name": "PYTHONUNBUFFERED", "value": "1"},
           # torchrun's grace between passing SIGTERM to the ranks and SIGKILL: the save.
           {"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": str(max(job.grace_s - 10, 1))},
           {"name": "OMP_NUM_THREADS", "value": str(max(cpus // job.procs_per_node, 1))}]
    mounts = [{"name": "runs", "mountPath": f"{job.mount_dir}/runs"},
              {"name": "config", "mountPath": job.config_dir, "readOnly": True},
              {"name": "shm", "mountPath": "/dev/shm"}]
    volumes: list[dict[str, Any]] = [
        {"name": "runs", "persistentVolumeClaim": {"claimName": job.runs_pvc}},
        {"name": "config", "configMap": {"name": f"{job.name}-config"}},
        {"name": "shm", "emptyDir": {"medium": "Memory"}}]
    if job.data_pvc:
        mounts.append({"name": "data", "mountPath": f"{job.mount_dir}/data", "readOnly": True})
        volumes.append({"name": "data", "persistentVolumeClaim": {"claimName": job.data_pvc,
                                                                  "readOnly": True}})
    spec: dict[str, Any] = {
        "restartPolicy": "Never",  # podFailurePolicy requires it; a new pod replaces a failed one
        "terminationGracePeriodSeconds": job.grace_s,
        "containers": [{
            "name": CONTAINER, "image": job.image, "workingDir": job.mount_dir,
            "command": ["bash", "-c", pod_script(job, variant)],
            "ports": [{"name": "rendezvous", "containerPort": job.port}],
            "env": env, "resources": {k: v for k, v in resources.items() if v},
            "volumeMounts": mounts}],
        "volumes": volumes}
    if variant == "indexed":
        spec["subdomain"] = job.name  # pod i resolves as <name>-<i>.<name>
    return spec


def _meta(job: K8sJob, name: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/name": "hpctrain",
                                                     "hpctrain/run": job.name, **job.labels}}
    if job.namespace:
        meta["namespace"] = job.namespace
    return meta


def _job_spec(job: K8sJob, variant: Variant) -> dict[str, Any]:
    exit_75 = {"containerName": CONTAINER, "operator": "In", "values": [PREEMPTED]}
    if variant == "indexed":
        # A preempted pod (exit 75, or evicted) is replaced and resumes; not a failure.
        rules = [{"action": "Ignore", "onExitCodes": exit_75},
                 {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}]
        # One failure stops every pod's ranks: count a budget of restarts per pod.
        backoff = job.nodes * job.max_restarts
    else:
        # The JobSet restarts every pod on any Job failure; exit 75 fails the Job at once with
        # reason PodFailurePolicy, which the JobSet restarts without counting it.
        rules = [{"action": "FailJob", "onExitCodes": exit_75}]
        backoff = 0
    return {"completionMode": "Indexed", "completions": job.nodes, "parallelism": job.nodes,
            "backoffLimit": backoff, "podFailurePolicy": {"rules": rules},
            "template": {"metadata": {"labels": _meta(job, job.name)["labels"]},
                         "spec": _pod_spec(job, variant)}}


def manifests(job: K8sJob, variant: Variant = "indexed") -> list[dict[str, Any]]:
    """The objects to apply: ConfigMap, then Service + Job, or a JobSet."""
    job.validate(variant)
    config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(job, f"{job.name}-config"),
              "data": {"config.yaml": job.config_yaml,
                       **({TASK_FILE: job.task_py} if job.task_py is not None else {})}}
    if variant == "jobset":
        return [config, {
            "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": _meta(job, job.name),
            "spec": {
                "network": {"enableDNSHostnames": True, "subdomain": job.name,
                            "publishNotReadyAddresses": True},
                "failurePolicy": {"maxRestarts": job.max_restarts, "rules": [
                    {"name": "preempted", "action": "RestartJobSetAndIgnoreMaxRestarts",
                     "onJobFailureReasons": ["PodFailurePolicy"]}]},
                "replicatedJobs": [{"name": "node", "replicas": 1, "template": {
                    "spec": _job_spec(job, variant)}}]}}]
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(job, job.name),
               "spec": {"clusterIP": "None", "selector": {"hpctrain/run": job.name},
                        # Pod 0 must resolve before it is ready: it is the rendezvous.
                        "publishNotReadyAddresses": True,
                        "ports": [{"name": "rendezvous", "port": job.port}]}}
    return [config, service, {"apiVersion": "batch/v1", "kind": "Job",
                              "metadata": _meta(job, job.name), "spec": _job_spec(job, variant)}]


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the pod's shell, the config) as readable ``|`` blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render(objects: list[dict[str, Any]]) -> str:
    """One YAML stream (`kubectl apply -f` takes it as it is)."""
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, width=100)


def config_text(config: Path | None, overrides: list[str]) -> str:
    """The config file (already loaded once; None: the defaults) with the overrides applied,
    for the ConfigMap."""
    from hpctrain.config import apply_override

    raw = (yaml.safe_load(config.read_text(encoding="utf-8")) or {}) if config else {}
    for item in overrides:
        apply_override(raw, item)
    return yaml.safe_dump(raw, sort_keys=False)


def default_name(run_name: str) -> str:
    """run.name as a DNS label: lower case, other characters as '-'."""
    return re.sub(r"[^a-z0-9]+", "-", run_name.lower()).strip("-")[:40] or "hpctrain"


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``hpctrain k8s`` on the top-level parser's ``sub``."""
    k = sub.add_parser("k8s", help="Kubernetes manifests for a multi-node training job",
                       description="Write Kubernetes manifests for a multi-node training job: "
                       "a ConfigMap with the config, and an Indexed Job with a headless Service "
                       "(or a JobSet), one pod per node running torchrun. An evicted pod "
                       "checkpoints, exits 75 and is replaced without counting as a failure.")
    k.add_argument("config", type=Path, help="YAML config (its paths as the pods see them), "
                   "or a task file (.py, carried in the ConfigMap)")
    k.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    k.add_argument("--image", required=True, help="an image with hpctrain (containers/)")
    k.add_argument("--runs-pvc", required=True, metavar="CLAIM",
                   help="ReadWriteMany volume claim for runs and checkpoints")
    k.add_argument("--data-pvc", default=None, metavar="CLAIM",
                   help="volume claim with the data, mounted read-only at MOUNT/data")
    k.add_argument("--variant", choices=("indexed", "jobset"), default="indexed",
                   help="an Indexed Job with a headless Service, or a JobSet")
    k.add_argument("--nodes", type=int, default=1, help="pods, one per node")
    k.add_argument("--gpus-per-node", type=int, default=0,
                   help="GPUs per pod, one rank each (0: one CPU rank per pod)")
    k.add_argument("--cpus-per-node", default=None, help="CPU request per pod, e.g. 64")
    k.add_argument("--memory", default=None, help="memory request per pod, e.g. 512Gi")
    k.add_argument("--name", default=None, help="job name (default: run.name)")
    k.add_argument("--namespace", default=None,
                   help="namespace of every object (default: kubectl's current one)")
    k.add_argument("--mount-dir", default="/workspace", help="where volumes are mounted")
    k.add_argument("--grace-s", type=int, default=None,
                   help="seconds between SIGTERM and SIGKILL (default: preempt.grace_s + 60)")
    k.add_argument("--max-restarts", type=int, default=3,
                   help="restarts after failures (preemptions do not count)")
    k.add_argument("--python", default="python3", help="the interpreter inside the image")
    k.add_argument("-o", "--output", type=Path, default=None, metavar="FILE",
                   help="write the manifests to FILE (its folder is created), not to stdout")
    k.set_defaults(handler=run)


def run(args: argparse.Namespace) -> None:
    """``hpctrain k8s``."""
    from hpctrain.launch.output import write_output
    from hpctrain.launch.sbatch import check_placement
    from hpctrain.task import file_overrides, load_run_config

    task_py = None
    if args.config.suffix == ".py":
        world = args.nodes * (args.gpus_per_node or 1)
        cfg = load_run_config(args.config, args.overrides, world)
        task_py = args.config.read_text(encoding="utf-8")
        config_yaml = config_text(None, file_overrides(
            args.config, world, args.overrides, seen_as=f"{CONFIG_DIR}/{TASK_FILE}"))
        print(f"hpctrain: {args.config} goes into the ConfigMap alone: modules it imports "
              "must be in the image", file=sys.stderr)
    else:
        cfg = _checked_config(args)
        config_yaml = config_text(args.config, args.overrides)
    check_placement(cfg, args.nodes, args.gpus_per_node or 1)
    job = K8sJob(name=args.name or default_name(cfg.run.name), image=args.image,
                 runs_pvc=args.runs_pvc, config_yaml=config_yaml,
                 nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                 cpus_per_node=args.cpus_per_node, memory=args.memory,
                 namespace=args.namespace, data_pvc=args.data_pvc, mount_dir=args.mount_dir,
                 grace_s=args.grace_s or int(cfg.preempt.grace_s) + 60,
                 max_restarts=args.max_restarts, python=args.python, task_py=task_py)
    text = render(manifests(job, args.variant))
    if args.output is None:
        print(text, end="")
    else:
        write_output(args.output, text)
        print(f"wrote {args.output}: kubectl apply -f {args.output}; the run is "
              f"{job.run_dir} on volume {job.runs_pvc}", file=sys.stderr)


def _checked_config(args: argparse.Namespace):
    """The config, checked here but for its data paths (they name the pods' folders)."""
    from hpctrain.config import load_config

    try:
        return load_config(args.config, args.overrides)
    except ConfigError:
        # data.path names a folder inside the pods: check everything else here.
        cfg = load_config(args.config, [*args.overrides, "data.source=stdlib",
                                        "data.path=null", "data.mix=null"])
        print("hpctrain: data paths are checked in the pods (they name the pods' folders)",
              file=sys.stderr)
    return cfg
