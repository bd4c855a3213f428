"""deploy/ (docs/operations.md "Cluster mode" > "Deploying"): the systemd units pass
`systemd-analyze verify`, every Kubernetes manifest passes `kubernetes-validate --strict`
(the OpenAPI schemas of Kubernetes, kubernetes-validate's newest version), and every flag
and `SANDLOT_*` variable they hand the binary is one that `sandlot server --help` /
`sandlot node --help` of the binary under test names."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SYSTEMD = ROOT / "deploy" / "systemd"
KUBERNETES = ROOT / "deploy" / "kubernetes"
INSTALLED_BIN = "/usr/local/bin/sandlot"  # where the units and images put the binary

try:
    import yaml
except ImportError:  # pragma: no cover - reported as a skip
    yaml = None  # type: ignore[assignment]
try:
    import kubernetes_validate
except ImportError:  # pragma: no cover - reported as a skip
    kubernetes_validate = None  # type: ignore[assignment]


def _manifests() -> list[Path]:
    return sorted(KUBERNETES.glob("*.yaml"))


def _units() -> list[Path]:
    return sorted(SYSTEMD.glob("*.service"))


def _help(binary: Path, sub: str) -> tuple[set[str], set[str]]:
    """(long flags, clap `[env: NAME=]` variables) of `sandlot SUB --help`."""
    out = subprocess.run([str(binary), sub, "--help"], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    flags = set(re.findall(r"^\s+(?:-\w, )?(--[a-z0-9][a-z0-9-]*)", out, re.M))
    envs = set(re.findall(r"\[env: ([A-Z0-9_]+)=", out))
    assert "--help" in flags and flags - {"--help"}, out
    return flags, envs


def _code(text: str) -> str:
    """TEXT without comment lines (`#` first on the line)."""
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


def test_there_is_a_unit_and_a_workload_per_binary():
    assert [p.name for p in _units()] == ["sandlot-node.service", "sandlot-server.service"]
    kinds = set()
    for p in _manifests():
        assert yaml is not None, "PyYAML missing (a dependency of kubernetes-validate)"
        for doc in yaml.safe_load_all(p.read_text()):
            kinds.add((doc["kind"], doc["metadata"]["name"]))
    assert {("DaemonSet", "sandlot-node"), ("Deployment", "sandlot-server"),
            ("Service", "sandlot"), ("ConfigMap", "sandlot"),
            ("Secret", "sandlot-node-token")} <= kinds, kinds


@pytest.mark.parametrize("manifest", _manifests(), ids=lambda p: p.name)
def test_kubernetes_manifest_is_valid(manifest):
    if kubernetes_validate is None or yaml is None:
        pytest.skip("kubernetes-validate not installed (scripts/setup.sh installs it in .venv)")
    version = kubernetes_validate.latest_version()
    docs = [d for d in yaml.safe_load_all(manifest.read_text()) if d is not None]
    assert docs, manifest
    for doc in docs:
        # Raises ValidationError (with the path of the bad field) on a schema violation;
        # strict: unknown fields are errors too.
        kubernetes_validate.validate(doc, version, strict=True)


def test_systemd_units_verify(binary, tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("no systemd-analyze on this host (Debian's systemd package)")
    # verify checks that ExecStart's program exists: point the copies at the binary under test.
    for unit in _units():
        (tmp_path / unit.name).write_text(
            unit.read_text().replace(INSTALLED_BIN, str(Path(binary).resolve())))
    out = subprocess.run(["systemd-analyze", "verify", *sorted(map(str, tmp_path.iterdir()))],
                         capture_output=True, text=True, timeout=60)
    # An unknown key or bad value is only a warning (exit 0): any output fails the test.
    assert out.returncode == 0 and out.stdout.strip() == "" and out.stderr.strip() == "", \
        out.stdout + out.stderr


@pytest.mark.parametrize("sub", ["node", "server"])
def test_systemd_units_use_real_flags_and_variables(binary, sub):
    flags, envs = _help(binary, sub)
    unit = (SYSTEMD / f"sandlot-{sub}.service").read_text()
    m = re.search(r"^ExecStart=(.*?)(?<!\\)$", unit, re.M | re.S)
    assert m, unit
    cmd = m.group(1).replace("\\\n", " ").split()
    assert cmd[:2] == [INSTALLED_BIN, sub], cmd
    used = {a.split("=")[0] for a in cmd if a.startswith("--")}
    assert used and used <= flags, sorted(used - flags)
    # Every variable of the environment file is used in ExecStart or read by the binary.
    env_file = SYSTEMD / f"{sub}.env"
    assert f"EnvironmentFile=/etc/sandlot/{sub}.env" in unit
    names = re.findall(r"^([A-Z0-9_]+)=", env_file.read_text(), re.M)
    assert names
    for name in names:
        assert "${" + name + "}" in m.group(1) or name in envs, (name, sorted(envs))
    for ref in re.findall(r"\$\{([A-Z0-9_]+)\}", m.group(1)):
        assert ref in names, ref


def _containers(binary):
    """(file, pod spec, container, subcommand) of every container that runs sandlot."""
    found = []
    for p in _manifests():
        for doc in yaml.safe_load_all(p.read_text()):
            spec = (doc.get("spec") or {}).get("template", {}).get("spec")
            for c in (spec or {}).get("containers", []):
                if c.get("command", [""])[0] == INSTALLED_BIN:
                    found.append((p.name, spec, c, c["command"][1]))
    return found


def test_kubernetes_workloads_use_real_flags_and_variables(binary):
    if yaml is None:
        pytest.skip("PyYAML not installed (scripts/setup.sh installs kubernetes-validate)")
    config = {}
    for p in _manifests():
        for doc in yaml.safe_load_all(p.read_text()):
            if doc["kind"] == "ConfigMap":
                config[doc["metadata"]["name"]] = set(doc["data"])
    containers = _containers(binary)
    assert sorted(s for _, _, _, s in containers) == ["node", "server"], containers
    used_keys: set[str] = set()
    for name, spec, c, sub in containers:
        flags, envs = _help(binary, sub)
        args = c.get("args", [])
        used = {a.split("=")[0] for a in args if a.startswith("--")}
        assert used and used <= flags, (name, sorted(used - flags))
        # Every $(VAR) in args is defined by env or by a ConfigMap of envFrom.
        defined = {e["name"] for e in c.get("env", [])}
        maps = [config[e["configMapRef"]["name"]] for e in c.get("envFrom", [])
                if "configMapRef" in e]
        for keys in maps:
            defined |= keys
        refs = set(re.findall(r"\$\(([A-Z0-9_]+)\)", " ".join(args)))
        assert refs <= defined, (name, sorted(refs - defined))
        # A ConfigMap key the container gets is used in its args or read by its binary.
        for keys in maps:
            for key in keys:
                if key in refs or key in envs:
                    used_keys.add(key)
        # Every volume mount names a volume of the pod.
        volumes = {v["name"] for v in spec.get("volumes", [])}
        assert {m["name"] for m in c.get("volumeMounts", [])} <= volumes, name
    assert used_keys == set().union(*config.values()), (used_keys, config)
    # The token file the containers read is the Secret's key.
    for _, spec, c, sub in containers:
        flag = "--token-file" if sub == "node" else "--node-token-file"
        path = next(a.split("=", 1)[1] for a in c["args"] if a.startswith(flag + "="))
        mount = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
        vol = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        assert vol["secret"]["secretName"] == "sandlot-node-token"
        assert path.rsplit("/", 1)[1] == "node-token"


def test_deploy_files_mention_only_real_flags_in_code(binary):
    """No flag in a non-comment line of deploy/ that neither subcommand knows."""
    known = _help(binary, "node")[0] | _help(binary, "server")[0]
    for p in sorted((ROOT / "deploy").rglob("*")):
        if p.is_file():
            used = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", _code(p.read_text())))
            assert used <= known, (p.name, sorted(used - known))
