"""CUDA that matches the driver: the image, the pinned torch's CUDA wheels and the cloud images agree.

torch 2.13.0 from PyPI is a CUDA 13 build (its Linux x86_64 wheel depends on CUDA 13 wheels, which
``constraints-cuda.txt`` pins, as pip resolved them: ``scripts/lock_cuda.py``). The node image
(``deploy/Dockerfile``) must be a CUDA image of the same major version, used by every cluster
configuration, and the GPU nodes' drivers must run it. These checks read the files only (no GPU, no
network).
"""

import re
from pathlib import Path

import pytest
import torch
import yaml

from rfedray.cuda import MINIMUM_DRIVER, cuda_report

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
LOCK = ROOT / "constraints-cuda.txt"
CLUSTER_CONFIGS = [ROOT / "deploy" / "aws.yaml", ROOT / "deploy" / "gcp.yaml"]
MANIFESTS = [ROOT / "deploy" / "kuberay" / "raycluster.yaml", ROOT / "deploy" / "kuberay" / "rayjob.yaml"]
AWS_GPU_AMI = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/"


def pins(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[re.sub(r"[-_.]+", "-", name).lower()] = version
    return out


def image_cuda_major(dockerfile: str) -> int:
    """The CUDA major version of the Dockerfile's ``FROM nvidia/cuda:X.Y.Z-...`` base image."""
    match = re.search(r"^FROM nvidia/cuda:(\d+)\.\d+(?:\.\d+)?-", dockerfile, flags=re.M)
    assert match, "deploy/Dockerfile must start from an nvidia/cuda:X.Y.Z-... image"
    return int(match.group(1))


def wheel_cuda_majors(lock: str) -> dict[str, int]:
    """The CUDA major version each CUDA wheel of the lock belongs to."""
    majors = {}
    for name, version in pins(lock).items():
        suffix = re.search(r"-cu(\d+)$", name)
        if suffix:
            majors[name] = int(suffix.group(1))
        elif name in ("cuda-toolkit", "nvidia-cuda-runtime", "nvidia-cuda-nvrtc", "nvidia-cuda-cupti"):
            majors[name] = int(version.split(".")[0])
    return majors


def disagreements(dockerfile: str, lock: str) -> list[str]:
    """Every CUDA wheel of the lock whose CUDA major is not the image's."""
    image = image_cuda_major(dockerfile)
    return [f"{name} is CUDA {major}, the image CUDA {image}"
            for name, major in sorted(wheel_cuda_majors(lock).items()) if major != image]


def test_the_lock_pins_the_cuda_wheels_of_the_pinned_torch():
    lock, constraints = LOCK.read_text(), (ROOT / "constraints.txt").read_text()
    pinned = pins(constraints)["torch"]
    assert f"torch=={pinned} " in lock.splitlines()[0] + " ", "constraints-cuda.txt was made for another torch pin"
    assert not set(pins(lock)) & set(pins(constraints)), "constraints-cuda.txt repeats constraints.txt"
    majors = wheel_cuda_majors(lock)
    assert {"cuda-toolkit", "nvidia-cuda-runtime", "nvidia-cudnn-cu13"} <= set(majors)
    assert len(set(majors.values())) == 1, majors


def test_the_image_cuda_major_is_the_pinned_torchs():
    dockerfile, lock = DOCKERFILE.read_text(), LOCK.read_text()
    assert disagreements(dockerfile, lock) == []
    assert image_cuda_major(dockerfile) == 13
    install = 'pip install -c constraints.txt -c constraints-cuda.txt "torch==$(grep \'^torch==\' constraints.txt | cut -d= -f3)"'
    assert install in dockerfile and "COPY constraints.txt constraints-cuda.txt ./" in dockerfile


def test_the_check_fails_for_the_old_cuda_12_image():
    """The image this repository shipped before (CUDA 12.8) against torch 2.13.0's CUDA 13 wheels."""
    old = DOCKERFILE.read_text().replace("FROM nvidia/cuda:13.0.2-base-ubuntu22.04", "FROM nvidia/cuda:12.8.1-base-ubuntu22.04")
    problems = disagreements(old, LOCK.read_text())
    assert "nvidia-cuda-runtime is CUDA 13, the image CUDA 12" in problems and len(problems) >= 5


def test_every_cluster_runs_the_one_image():
    names = set()
    for path in CLUSTER_CONFIGS:
        docker = yaml.safe_load(path.read_text())["docker"]
        names.add(docker["image"].rsplit("/", 1)[-1])
        assert docker["pull_before_run"] is True and "head_image" not in docker and "worker_image" not in docker
    for path in MANIFESTS:
        for image in re.findall(r"image: (\S+)", path.read_text()):
            names.add(image.rsplit("/", 1)[-1])
    assert names == {"rfedray:0.1.0"}
    assert "docker build -f deploy/Dockerfile -t rfedray:0.1.0 ." in DOCKERFILE.read_text()


def test_the_gpu_nodes_drivers_run_the_image():
    major = image_cuda_major(DOCKERFILE.read_text())
    needed = int(MINIMUM_DRIVER[major].split(".")[0])
    gcp = yaml.safe_load((ROOT / "deploy" / "gcp.yaml").read_text())["available_node_types"]["worker_gpu"]
    family = gcp["node_config"]["disks"][0]["initializeParams"]["sourceImage"]
    driver = re.search(r"-nvidia-(\d+)$", family)
    assert driver and int(driver.group(1)) >= needed, family  # the Deep Learning VM family names its driver
    aws = yaml.safe_load((ROOT / "deploy" / "aws.yaml").read_text())["available_node_types"]["worker_gpu"]
    assert aws["node_config"]["ImageId"] == f"resolve:ssm:{AWS_GPU_AMI}latest/ami-id"  # drivers 580+ in its recent releases
    for path in CLUSTER_CONFIGS:  # a worker whose driver is older fails its set-up, naming both versions
        assert yaml.safe_load(path.read_text())["worker_setup_commands"] == ["python -m rfedray.cuda"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="describes a machine where torch cannot use CUDA")
def test_the_cuda_report_names_the_build_and_the_driver():
    report = cuda_report()
    assert report.startswith(f"torch {torch.__version__} is ")
    assert "driver" in report and "torch says:" in report
