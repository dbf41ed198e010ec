"""A headless Chromium for the HTML tests: the one on PATH, the one named by
LONGSTRAW_CHROMIUM, or Debian's chromium package and the libraries it needs
beyond the base system, fetched with apt-get and unpacked (dpkg -x) into a
cache directory, so no root install is needed."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess

CACHE = pathlib.Path(os.environ.get("LONGSTRAW_BROWSER_CACHE", pathlib.Path.home() / ".cache" / "longstraw" / "chromium"))


class NoBrowser(RuntimeError):
    pass


def chromium() -> tuple[str, dict[str, str]]:
    """(executable, environment) of a headless-capable Chromium."""
    named = os.environ.get("LONGSTRAW_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if named:
        return named, dict(os.environ)
    binary = CACHE / "root" / "usr" / "lib" / "chromium" / "chromium"
    if not binary.exists():
        _fetch()
    libs = sorted({str(p.parent) for p in (CACHE / "root").rglob("*.so*")})
    env = dict(os.environ, LD_LIBRARY_PATH=":".join([*libs, os.environ.get("LD_LIBRARY_PATH", "")]))
    return str(binary), env


def _fetch() -> None:
    if not shutil.which("apt-get") or not shutil.which("dpkg"):
        raise NoBrowser("no chromium on PATH and no apt-get/dpkg to fetch Debian's; set LONGSTRAW_CHROMIUM")
    debs = CACHE / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    packages = _missing_packages("chromium")
    subprocess.run(["apt-get", "download", *packages], cwd=debs, check=True, capture_output=True)
    for deb in debs.glob("*.deb"):
        subprocess.run(["dpkg", "-x", str(deb), str(CACHE / "root")], check=True)


def _missing_packages(root: str) -> list[str]:
    """`root` and its (first-alternative) dependencies that are not installed."""
    todo, seen, missing = [root], set(), []
    while todo:
        package = todo.pop()
        if package in seen:
            continue
        seen.add(package)
        status = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True).stdout
        if status.strip() == "install ok installed":
            continue
        missing.append(package)
        todo += _depends(package)
    return missing


def _depends(package: str) -> list[str]:
    out = subprocess.run(
        ["apt-cache", "depends", "--no-recommends", "--no-suggests", "--no-conflicts", "--no-breaks",
         "--no-replaces", "--no-enhances", package],
        capture_output=True, text=True,
    ).stdout
    deps, alternative = [], False
    for line in out.splitlines():
        match = re.match(r"\s+(\|)?(?:Pre)?Depends: <?([^>\s]+)>?", line)
        if match:
            if not alternative:
                deps.append(match.group(2))
            alternative = bool(match.group(1))
    return deps


def run(url: str, *flags: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Chromium headless on `url`; stderr carries the page's console (`CONSOLE` lines)."""
    binary, env = chromium()
    args = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0", *flags, url]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)


def console_messages(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]
