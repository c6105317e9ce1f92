"""docker-compose.yml without a Docker engine: mounts exist, commands parse with the project's CLIs."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import tomllib
import yaml
from dashboard_queries import ROOT

COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def _command(service: str) -> list[str]:
    cmd = SERVICES[service]["command"]
    return shlex.split(cmd) if isinstance(cmd, str) else [str(a) for a in cmd]


def _module_args(argv: list[str], module: str) -> list[str]:
    assert argv[:3] == ["python", "-m", module], f"expected `python -m {module} ...`, got {argv}"
    return argv[3:]


def _parse(build_parser, args: list[str]):
    try:
        return build_parser().parse_args(args)
    except SystemExit as exc:  # argparse exits on unknown flags or bad values
        pytest.fail(f"arguments {args} do not parse (exit {exc.code})")


def _binds(service: str) -> list[tuple[str, str]]:
    """(host path, container path) of every bind mount of a service."""
    out = []
    for volume in SERVICES[service].get("volumes", []):
        if isinstance(volume, dict):
            if volume.get("type") == "bind":
                out.append((volume["source"], volume["target"]))
            continue
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/", "~")):
            out.append((source, target))
        else:
            assert source in (COMPOSE.get("volumes") or {}), f"{service}: undeclared named volume {source}"
    return out


def _reserves_gpu(service: str) -> bool:
    devices = SERVICES[service].get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return any("gpu" in d.get("capabilities", []) for d in devices)


def _flag(argv: list[str], prefix: str) -> str:
    found = [a.split("=", 1)[1] for a in argv if a.startswith(prefix + "=")]
    assert found, f"{prefix} missing from {argv}"
    return found[0]


def test_services():
    assert {"worker", "exporter", "prometheus", "alertmanager", "grafana"} <= set(SERVICES)
    for name, service in SERVICES.items():
        for dep in service.get("depends_on", []):
            assert dep in SERVICES, f"{name} depends on unknown service {dep}"


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_bind_mounts_exist(service):
    for source, _ in _binds(service):
        assert (ROOT / source).exists(), f"{service}: mounted path {source} is not in the repository"


def test_images_build_from_the_repo_dockerfile():
    for name in ("worker", "exporter"):
        build = SERVICES[name]["build"]
        context = ROOT / (build if isinstance(build, str) else build.get("context", "."))
        dockerfile = "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
        assert (context / dockerfile).is_file(), f"{name}: {context / dockerfile} missing"
    dockerfile = (ROOT / "Dockerfile").read_text()
    for line in re.findall(r"^COPY\s+(.+)$", dockerfile, re.MULTILINE):
        *sources, _ = shlex.split(line)
        for source in sources:
            if not source.startswith("--"):
                assert (ROOT / source).exists(), f"Dockerfile copies {source}, which is not in the repository"
    assert re.search(r"^RUN\s+pip install '?\.", dockerfile, re.MULTILINE), "the image must pip install the project"
    # Every folder the distribution installs from is copied in before the install, or the image lacks it:
    # its packages, and the folders they link (vramledger/worker -> worker/).
    packages = {p.split(".")[0] for p in tomllib.loads((ROOT / "pyproject.toml").read_text())
                ["tool"]["setuptools"]["packages"]["find"]["include"]}
    linked = {link.resolve().name for p in packages for link in (ROOT / p).iterdir() if link.is_symlink()}
    assert linked == {"worker", "exporter"}
    copied = {shlex.split(line)[0] for line in re.findall(r"^COPY\s+(.+)$", dockerfile, re.MULTILINE)}
    assert packages | linked <= copied, f"Dockerfile does not copy {(packages | linked) - copied}"


def test_the_image_ships_its_cpu_kernels_prebuilt():
    from vramledger.worker.kernels import native

    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(rf"^ENV\b.*\b{native.PREBUILT_ENV}=(\S+)", dockerfile, re.MULTILINE | re.DOTALL)
    assert f'python -m vramledger.worker.kernels.native "${native.PREBUILT_ENV}"' in dockerfile


def _worker_args():
    from vramledger.worker.cli import build_parser

    args = _module_args(_command("worker"), "vramledger.worker")
    assert args[0] == "serve", "the worker service runs `python -m vramledger.worker serve`"
    return _parse(build_parser, args)


def _exporter_args():
    from vramledger.exporter.cli import build_parser

    return _parse(build_parser, _module_args(_command("exporter"), "vramledger.exporter"))


def test_worker_command_parses_with_the_worker_cli():
    ns = _worker_args()
    assert ns.host == "0.0.0.0" and ns.port == 8000
    assert ns.device.startswith("cuda")
    assert _reserves_gpu("worker"), "worker: GPU not reserved under deploy.resources.reservations.devices"


def test_exporter_command_parses_with_the_exporter_cli():
    ns = _exporter_args()
    assert ns.host == "0.0.0.0" and ns.port == 9400
    assert ns.backend == "nvml"
    assert ns.worker == ["http://worker:8000"]
    assert SERVICES["exporter"].get("pid") == "host", "exporter needs host pids to match NVML's process list"
    assert _reserves_gpu("exporter"), "exporter: GPU not visible"


def test_dockerfile_default_command_parses():
    from vramledger.worker.cli import build_parser

    cmd = re.search(r"^CMD\s+(\[.*\])\s*$", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert cmd, "Dockerfile needs an exec-form CMD"
    _parse(build_parser, _module_args(yaml.safe_load(cmd.group(1)), "vramledger.worker"))


def test_prometheus_scrapes_the_compose_services():
    config = yaml.safe_load((ROOT / "prometheus" / "prometheus.yml").read_text())
    targets = {job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
               for job in config["scrape_configs"]}
    assert targets["vramledger-worker"] == [f"worker:{_worker_args().port}"]
    assert targets["vramledger-exporter"] == [f"exporter:{_exporter_args().port}"]
    assert _exporter_args().worker == [f"http://worker:{_worker_args().port}"]
    alertmanagers = [t for am in config["alerting"]["alertmanagers"] for sc in am["static_configs"]
                     for t in sc["targets"]]
    assert alertmanagers == ["alertmanager:9093"]


def test_prometheus_gets_its_config_and_rules():
    argv = _command("prometheus")
    mounts = {target: source for source, target in _binds("prometheus")}
    config = _flag(argv, "--config.file")
    assert Path(mounts[config]) == Path("./prometheus/prometheus.yml")
    rules_dir = str(Path(config).parent / "rules")
    assert Path(mounts[rules_dir]) == Path("./prometheus/rules"), "rules must sit next to the config"


def test_alertmanager_gets_its_config():
    mounts = {target: source for source, target in _binds("alertmanager")}
    assert Path(mounts[_flag(_command("alertmanager"), "--config.file")]) == Path("./prometheus/alertmanager.yml")


def test_grafana_provisioning_and_anonymous_viewer():
    grafana = SERVICES["grafana"]
    env = grafana["environment"]
    env = dict(e.split("=", 1) for e in env) if isinstance(env, list) else env
    assert str(env["GF_AUTH_ANONYMOUS_ENABLED"]).lower() == "true"
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"

    mounts = {target: source for source, target in _binds("grafana")}
    assert Path(mounts["/etc/grafana/provisioning/datasources"]) == Path("./dashboards/provisioning/datasources")
    assert Path(mounts["/etc/grafana/provisioning/dashboards"]) == Path("./dashboards/provisioning/dashboards")
    providers = [p for f in sorted((ROOT / "dashboards/provisioning/dashboards").glob("*.yml"))
                 for p in yaml.safe_load(f.read_text())["providers"]]
    served = {Path(t).name for t, s in mounts.items()
              if any(Path(t).parent == Path(p["options"]["path"]) for p in providers)}
    assert {"memory-ledger.json", "serving.json"} <= served, "dashboards not mounted where the provider looks"
