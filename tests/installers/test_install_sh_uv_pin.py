"""The standalone uv comes from its PyPI wheel and is checked against the sha256 pinned beside the
version in install.sh (install.ps1 the same for Windows), never against a checksum fetched from where
uv itself comes from. A wrong hash refuses with one clear line and leaves nothing installed."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SH, PS1 = REPO / "install.sh", REPO / "install.ps1"
VERSION = re.search(r"^UV_VERSION=(\S+)", SH.read_text(), re.M).group(1)
TARGETS = ["x86_64-unknown-linux-gnu", "aarch64-unknown-linux-gnu", "aarch64-apple-darwin", "x86_64-apple-darwin"]


def functions_then(driver: str) -> str:
    """install.sh's definitions (everything but its last line, `main "$@"`), then ``driver``."""
    text = SH.read_text().rstrip("\n")
    assert text.endswith('main "$@"')
    return text[: -len('main "$@"')] + driver


def pinned(target: str) -> tuple[str, str]:
    done = subprocess.run(["sh", "-c", functions_then(f"uv_wheel {target}\n")], capture_output=True, text=True, check=True)
    url, sha256 = done.stdout.split()
    return url, sha256


@pytest.mark.parametrize("target", TARGETS)
def test_each_target_has_a_pinned_pypi_wheel(target):
    url, sha256 = pinned(target)
    assert url.startswith("https://files.pythonhosted.org/packages/") and f"/uv-{VERSION}-py3-none-" in url
    assert url.endswith(".whl") and re.fullmatch(r"[0-9a-f]{64}", sha256)


def test_every_target_install_sh_downloads_for_is_pinned():
    """uv_target's answers and uv_wheel's rows are the same set: no target falls through to no hash."""
    targets = set(re.findall(r"echo ([a-z0-9_]+-(?:unknown-linux-gnu|apple-darwin))", SH.read_text()))
    assert targets == set(TARGETS)


def test_install_ps1_pins_the_windows_wheels_of_the_same_version():
    text = PS1.read_text()
    assert re.search(r"^\$UnslothUvVersion = '(\S+)'", text, re.M).group(1) == VERSION
    rows = re.findall(r"'(\w+-pc-windows-msvc)'\s*=\s*@\('(\S+)', '([0-9a-f]{64})'\)", text)
    assert {target for target, _, _ in rows} == {"x86_64-pc-windows-msvc", "aarch64-pc-windows-msvc"}
    for _, url, _ in rows:
        assert url.startswith("https://files.pythonhosted.org/packages/") and f"/uv-{VERSION}-py3-none-win" in url
    assert ".sha256" not in text and "astral-sh/uv/releases" not in text  # the hash is not fetched


@pytest.fixture
def mirror(tmp_path):
    """A folder holding a stand-in wheel under the pinned file name (so its hash cannot match the pin)."""
    url, _ = pinned(TARGETS[0])
    folder = tmp_path / "mirror"
    folder.mkdir()
    wheel = folder / url.rsplit("/", 1)[1]
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"uv-{VERSION}.data/scripts/uv", "#!/bin/sh\necho stand-in uv\n")
        archive.writestr(f"uv-{VERSION}.dist-info/METADATA", "Name: uv\n")
    return folder, hashlib.sha256(wheel.read_bytes()).hexdigest()


def download(tmp_path, folder: Path, **env) -> subprocess.CompletedProcess:
    home, scratch = tmp_path / "home", tmp_path / "scratch"
    scratch.mkdir(exist_ok=True)
    driver = 'OS=linux; ARCH=x86_64; UNSLOTH_HOME="$1"; download_uv; echo "UV=$UV"\n'
    return subprocess.run(["sh", "-c", functions_then(driver), "sh", str(home)], capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TMPDIR": str(scratch),
                                           "UNSLOTH_UV_DOWNLOAD_URL": folder.as_uri(), **env})


def test_a_wheel_that_does_not_match_the_pin_is_refused_and_nothing_is_installed(tmp_path, mirror):
    folder, actual = mirror
    done = download(tmp_path, folder)
    assert done.returncode == 1
    error = done.stderr.splitlines()[-1]
    assert error.startswith("error: the uv download from file://") and "corrupt or tampered with" in error
    assert f"sha256 {actual}, expected {pinned(TARGETS[0])[1]}" in error and "nothing was installed" in error
    assert "UNSLOTH_UV_SHA256" in error  # the setting that fixes a mirror's own build
    assert "UV=" not in done.stdout and not (tmp_path / "home").exists()
    assert list((tmp_path / "scratch").iterdir()) == []  # the download is gone too


def test_a_wrong_hash_given_is_refused_the_same_way(tmp_path, mirror):
    folder, actual = mirror
    done = download(tmp_path, folder, UNSLOTH_UV_SHA256="0" * 64)
    assert done.returncode == 1 and f"sha256 {actual}, expected {'0' * 64}" in done.stderr
    assert not (tmp_path / "home").exists() and list((tmp_path / "scratch").iterdir()) == []


def test_the_matching_wheel_is_unpacked_to_the_uv_folder(tmp_path, mirror):
    folder, actual = mirror
    done = download(tmp_path, folder, UNSLOTH_UV_SHA256=actual)
    uv = tmp_path / "home" / "uv" / "uv"
    assert done.returncode == 0, done.stderr
    assert f"UV={uv}" in done.stdout
    assert subprocess.run([str(uv)], capture_output=True, text=True).stdout == "stand-in uv\n"
    assert sorted(p.name for p in uv.parent.iterdir()) == ["uv"] and list((tmp_path / "scratch").iterdir()) == []


def _all_pins() -> list[tuple[str, str]]:
    rows = [pinned(target) for target in TARGETS]
    return rows + [(url, sha) for _, url, sha in
                   re.findall(r"'(\w+-pc-windows-msvc)'\s*=\s*@\('(\S+)', '([0-9a-f]{64})'\)", PS1.read_text())]


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.parametrize("url, sha256", _all_pins(), ids=lambda value: value.rsplit("/", 1)[-1][:40])
def test_each_pin_is_the_hash_of_the_wheel_pypi_serves(url, sha256):
    """The pins are right: what PyPI serves at each URL hashes to the pinned value (a wrong pin would
    refuse every standalone install on that platform)."""
    import urllib.request

    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=120) as response:
        for block in iter(lambda: response.read(1 << 20), b""):
            digest.update(block)
    assert digest.hexdigest() == sha256


def _proxies() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name.lower().endswith("_proxy")}


@pytest.mark.slow
@pytest.mark.network
def test_the_real_standalone_uv_installs_and_runs(tmp_path):
    """This machine's target, from PyPI, through install.sh's own download_uv."""
    import platform

    if (platform.system(), platform.machine()) != ("Linux", "x86_64"):
        pytest.skip("the driver below names linux/x86_64")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    driver = 'OS=linux; ARCH=x86_64; UNSLOTH_HOME="$1"; download_uv; "$UV" --version\n'
    done = subprocess.run(["sh", "-c", functions_then(driver), "sh", str(tmp_path / "home")], capture_output=True,
                          text=True, timeout=300, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                                                       "TMPDIR": str(scratch), **_proxies()})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"uv {VERSION} ") and list(scratch.iterdir()) == []
