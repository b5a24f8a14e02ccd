"""Offline checks of the cluster manifests: Ray's own autoscaler schema, Serve's deploy schema, KubeRay structure."""

from __future__ import annotations

import shlex

import yaml

from draftline.config import load_config
from conftest import REPO

CLUSTER = REPO / "configs" / "cluster"


def _load(name):
    return list(yaml.safe_load_all((CLUSTER / name).read_text()))


def test_ray_up_yaml_passes_rays_schema():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = _load("ray-up-aws.yaml")[0]
    # prepare_config fills Ray's defaults the way `ray up` does; validate_config checks ray-schema.json.
    validate_config(prepare_config(config))
    assert any("RAY_AUTH_MODE=token" in c for c in config["head_start_ray_commands"])
    assert any("torch==2.13.0" in c for c in config["setup_commands"])


def _entrypoint_config(entrypoint: str):
    argv = shlex.split(entrypoint)
    assert argv[:2] == ["python", "jobs/pipeline.py"] and (REPO / argv[1]).exists()
    return load_config(REPO / argv[argv.index("--config") + 1])


def _check_ray_cluster_spec(spec: dict) -> int:
    """Returns the GPUs of the largest worker pod."""
    assert spec["rayVersion"] == "2.60.0"
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {"name": "RAY_AUTH_MODE", "value": "token"} in head["env"]
    gpus = 0
    for group in spec["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        container = group["template"]["spec"]["containers"][0]
        assert container["resources"]["requests"] == container["resources"]["limits"]
        gpus = max(gpus, int(container["resources"]["limits"].get("nvidia.com/gpu", 0)))
    return gpus


def test_rayjob_runs_the_pipeline_on_enough_gpus():
    job = _load("rayjob-pipeline.yaml")[0]
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    cfg = _entrypoint_config(job["spec"]["entrypoint"])
    gpus = _check_ray_cluster_spec(job["spec"]["rayClusterSpec"])
    assert gpus >= cfg.train.num_workers == 4
    runtime_env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])
    assert runtime_env["env_vars"]["MLFLOW_TRACKING_URI"].startswith("http")
    assert cfg.extract.storage_uri.startswith("s3://")


def test_rayservice_serve_config_passes_serve_schema():
    from ray.serve.schema import ServeDeploySchema

    service = _load("rayservice.yaml")[0]
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    serve_config = ServeDeploySchema.model_validate(yaml.safe_load(service["spec"]["serveConfigV2"])) \
        if hasattr(ServeDeploySchema, "model_validate") else ServeDeploySchema.parse_obj(yaml.safe_load(service["spec"]["serveConfigV2"]))
    app = serve_config.applications[0]
    assert app.import_path == "serve.app:app"
    assert (REPO / "serve" / "app.py").exists()
    load_config(REPO / app.runtime_env["env_vars"]["DRAFTLINE_CONFIG"])
    assert _check_ray_cluster_spec(service["spec"]["rayClusterConfig"]) >= 1


def test_local_serve_config_passes_serve_schema():
    from ray.serve.schema import ServeDeploySchema

    data = yaml.safe_load((REPO / "serve" / "serve_config.yaml").read_text())
    ServeDeploySchema.model_validate(data) if hasattr(ServeDeploySchema, "model_validate") else ServeDeploySchema.parse_obj(data)


def test_mlflow_server_uses_postgres_and_object_store():
    deployment, service = _load("mlflow-server.yaml")
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--artifacts-destination") + 1].startswith("s3://")
    backend = deployment["spec"]["template"]["spec"]["containers"][0]["env"][0]
    assert backend["name"] == "MLFLOW_BACKEND_URI" and backend["valueFrom"]["secretKeyRef"]["name"] == "mlflow-postgres"
    assert service["spec"]["ports"][0]["port"] == 5000
