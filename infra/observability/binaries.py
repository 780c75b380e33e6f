"""Jaeger and Prometheus, and their UIs, built once on this machine and cached outside the clone.

Why built: the only registry this project reaches that carries either server is the Go module proxy,
as Go source. ``go`` builds each in a scratch module (``go get -tool PKG@VERSION``, ``go build``,
``CGO_ENABLED=0`` like their release builds) into ``<cache_dir>/bin/<name>-<version>/<name>``, where
every state folder, every test run and CI on the same machine find it again (the Kafka jars are kept
the same way). A build goes into a temporary folder beside that one and is renamed when complete,
under a lock: a half build is never taken for done, and two ``up``s at once build once. It runs at low
priority (``nice``) on half the cores, so a 2-core machine stays usable for the 6-15 minutes each takes.

The UIs are not in those Go modules:
- Jaeger's is the separate jaeger-ui repository (a React app, dependencies on npm), which no registry
  here carries: from a checkout at the tag matching Jaeger (``jaeger_ui_source``) npm builds it into
  ``<cache_dir>/bin/jaeger-ui-<version>/``, or ``jaeger_ui_source`` names assets built already (a
  folder, or a tarball unpacked there). Without
  it Jaeger serves its placeholder page; its query API works all the same.
- Prometheus's (``web/ui``, React/Mantine, pnpm) ships inside its Go module: npm fetches pnpm and
  builds it into ``<cache_dir>/bin/prometheus-ui-<version>/static/``, which a Prometheus built without
  the ``builtinassets`` tag serves from its working folder (``backends``). Without npm: the API and
  ``/metrics`` on its port work, the pages do not.

A missing tool is one line naming it. Not here: how the programs run (``backends``).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import tarfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Iterator

from infra.local_kafka import StackError
from infra.settings import StackSettings

Progress = Callable[[str], None]


class BuildError(StackError):
    """A backend or its UI could not be built; the message names the missing tool or the failed step."""


@dataclass(frozen=True, slots=True)
class GoProgram:
    name: str  # the binary's name, and the stack's service name
    package: str  # the Go package of its main
    version: str  # the Go module version (what the proxy knows)
    release: str  # what the project calls that release
    minutes: int  # about how long the build took on a 2-core machine (docs/observability.md)

    @property
    def module(self) -> str:
        return self.package.split("/cmd/")[0]


# Jaeger's v1 module tags carry the v2 program (cmd/jaeger, on the OpenTelemetry Collector); Prometheus
# 3.x is tagged v0.3xx.y as a Go module (v0.316.0 is 3.16.0).
JAEGER = GoProgram("jaeger", "github.com/jaegertracing/jaeger/cmd/jaeger", "v1.76.0", "Jaeger v2.13.0", 10)
PROMETHEUS = GoProgram("prometheus", "github.com/prometheus/prometheus/cmd/prometheus", "v0.316.0",
                       "Prometheus 3.16.0", 12)
PNPM = "pnpm@12.4.2"  # Prometheus's UI is a pnpm workspace (its CI takes pnpm < 13)
# Versions in Prometheus's pnpm-lock.yaml that the npm registry does not serve, and the nearest it does.
PROMETHEUS_UI_OVERRIDES = {"@mantine/code-highlight": "9.6.2"}
_STANDARD_GO = Path("/usr/local/go/bin/go")  # where Go's own installer puts it, often not on PATH


@dataclass(frozen=True, slots=True)
class Installed:
    """What the observability backends run: the two programs and, where built, their UIs."""

    jaeger: Path
    prometheus: Path
    jaeger_ui: Path | None  # a folder with index.html; None: Jaeger's placeholder page
    prometheus_ui: Path | None  # a folder holding static/mantine-ui; None: no pages, the API works


def bin_dir(settings: StackSettings) -> Path:
    return settings.cache_dir / "bin"


def program_path(settings: StackSettings, program: GoProgram) -> Path:
    return bin_dir(settings) / f"{program.name}-{program.version}" / program.name


def jaeger_ui_dir(settings: StackSettings) -> Path:
    return bin_dir(settings) / f"jaeger-ui-{JAEGER.version}"


def prometheus_ui_dir(settings: StackSettings) -> Path:
    return bin_dir(settings) / f"prometheus-ui-{PROMETHEUS.version}"


def installed(settings: StackSettings) -> Installed:
    """What is built already (nothing is built here); a missing program is an error saying how to build it."""
    programs = {p.name: program_path(settings, p) for p in (JAEGER, PROMETHEUS)}
    missing = [name for name, path in programs.items() if not path.is_file()]
    if missing:
        raise BuildError(f"{', '.join(missing)} not built in {bin_dir(settings)}: `chatpipe up --observability` "
                         "builds it (once, with Go)")
    return Installed(programs["jaeger"], programs["prometheus"], _jaeger_ui_found(settings),
                     _prometheus_ui_found(settings))


def ensure(settings: StackSettings, progress: Progress = lambda message: None, *, verbose: bool = False) -> Installed:
    """Build what is missing (the programs, then the UIs where the tools and sources are here); a failed
    UI build is said through ``progress`` and leaves that backend without pages, not without its API.
    ``verbose``: also one line per piece found cached, and one when a build is done (``build_all``)."""
    said = progress if verbose else lambda message: None
    for program in (JAEGER, PROMETHEUS):
        path, began = program_path(settings, program), time.monotonic()
        if path.is_file():
            said(f"{program.release}: cached ({path})")
            continue
        ensure_program(settings, program, progress)
        said(f"{program.release}: done in {time.monotonic() - began:.0f} s ({path})")
    for name, found, build in (("Jaeger UI", _jaeger_ui_found, ensure_jaeger_ui),
                               ("Prometheus UI", _prometheus_ui_found, ensure_prometheus_ui)):
        if (cached := found(settings)) is not None:
            said(f"{name}: cached ({cached})")
            continue
        began = time.monotonic()
        try:
            built = build(settings, progress)
        except BuildError as exc:
            progress(f"{name} not built, the backend runs without it: {exc}")
            continue
        if built is not None:
            said(f"{name}: done in {time.monotonic() - began:.0f} s ({built})")
    return installed(settings)


# --- the programs -----------------------------------------------------------------------------------
def find_go(settings: StackSettings, program: GoProgram) -> str:
    found = shutil.which(settings.go) or (str(_STANDARD_GO) if settings.go == "go" and _STANDARD_GO.is_file() else None)
    if found is None:
        raise BuildError(f"Go ({settings.go!r}) not found: it builds {program.release} once from the Go module "
                         f"proxy ({program.package}@{program.version}). Install Go 1.25 or newer, or set CHATPIPE_GO")
    return found


def ensure_program(settings: StackSettings, program: GoProgram, progress: Progress = lambda message: None) -> Path:
    """The program's binary, built first if it is not in the cache."""
    path = program_path(settings, program)
    if path.is_file():
        return path
    go = find_go(settings, program)
    with _building(path.parent) as tmp:
        if path.is_file():  # built by another `up` while this one waited for the lock
            return path
        log = _log(path.parent)
        progress(f"building {program.release} ({program.package}@{program.version}) with {go}, once, into "
                 f"{path.parent} (about {program.minutes} min on 2 cores; log {log})")
        began = time.monotonic()
        src = tmp / "src"
        src.mkdir()
        env = {**os.environ, "CGO_ENABLED": "0", "GOTOOLCHAIN": "local",
               "GOFLAGS": f"-p={max(1, (os.cpu_count() or 2) // 2)}"}  # on half the cores
        _run([go, "mod", "init", f"chatpipe.local/build/{program.name}"], src, env, log)
        _run([go, "get", "-tool", f"{program.package}@{program.version}"], src, env, log)
        _run([go, "build", "-trimpath", "-ldflags=-s -w", "-o", str(tmp / program.name), program.package], src, env, log)
        (tmp / "go.mod").write_text((src / "go.mod").read_text())  # what it was built from, kept beside it
        shutil.rmtree(src)
        progress(f"built {program.name} in {time.monotonic() - began:.0f} s")
    return path


# --- the UIs ----------------------------------------------------------------------------------------
def _jaeger_ui_found(settings: StackSettings) -> Path | None:
    if (jaeger_ui_dir(settings) / "index.html").is_file():
        return jaeger_ui_dir(settings)
    source = settings.jaeger_ui_source
    return source.resolve() if source is not None and (source / "index.html").is_file() else None


def ensure_jaeger_ui(settings: StackSettings, progress: Progress = lambda message: None) -> Path | None:
    """Jaeger's UI assets: cached, given built (``jaeger_ui_source`` with an index.html), or built with npm
    from a jaeger-ui checkout (``jaeger_ui_source``); None when there is no source for them."""
    found, source = _jaeger_ui_found(settings), settings.jaeger_ui_source
    if found is not None:
        return found
    if source is None:
        progress(f"no Jaeger UI: jaeger-ui is not on any registry here; set CHATPIPE_JAEGER_UI_SOURCE to a checkout "
                 f"of jaeger-ui at tag {JAEGER.version} (or to its built assets) to have it built into "
                 f"{jaeger_ui_dir(settings)}; Jaeger's query API works without it")
        return None
    if source.is_file() and tarfile.is_tarfile(source):
        return _unpack_jaeger_ui(settings, source)
    package = source / "packages" / "jaeger-ui" / "package.json"
    if not package.is_file():
        raise BuildError(f"{source} (CHATPIPE_JAEGER_UI_SOURCE) is neither a jaeger-ui checkout "
                         "(packages/jaeger-ui/package.json) nor built assets (index.html, or a tarball of them)")
    version = json.loads(package.read_text()).get("version")
    if f"v{version}" != JAEGER.version:
        raise BuildError(f"{source} is jaeger-ui {version}; Jaeger {JAEGER.version} needs the jaeger-ui tag "
                         f"{JAEGER.version} (`git checkout {JAEGER.version}`)")
    npm = _find_npm(settings, "the Jaeger UI")
    dest = jaeger_ui_dir(settings)
    with _building(dest) as tmp:
        log = _log(dest)
        progress(f"building the Jaeger UI from {source} with npm into {dest} (about 3 min; log {log})")
        src = tmp / "src"
        shutil.copytree(source, src, ignore=shutil.ignore_patterns("node_modules", ".git"))
        # Its .npmrc makes engines strict and asks for Node 24; it builds on the Node 20 here as well.
        _run([npm, "ci", "--engine-strict=false", "--no-audit", "--no-fund"], src, os.environ, log)
        _run([npm, "run", "build"], src / "packages" / "jaeger-ui", os.environ, log)
        for item in (src / "packages" / "jaeger-ui" / "build").iterdir():
            item.rename(tmp / item.name)
        shutil.rmtree(src)
    return dest


def _unpack_jaeger_ui(settings: StackSettings, tarball: Path) -> Path:
    """Built assets shipped as a tarball (index.html at its top), unpacked once into the cache."""
    dest = jaeger_ui_dir(settings)
    with _building(dest) as tmp, tarfile.open(tarball) as tar:
        tar.extractall(tmp, filter="data")  # no absolute paths, links out or devices
        if not (tmp / "index.html").is_file():
            raise BuildError(f"{tarball} (CHATPIPE_JAEGER_UI_SOURCE) has no index.html at its top: not the "
                             "Jaeger UI's built assets")
    return dest


def _prometheus_ui_found(settings: StackSettings) -> Path | None:
    return prometheus_ui_dir(settings) if (prometheus_ui_dir(settings) / ".complete").exists() else None


def ensure_prometheus_ui(settings: StackSettings, progress: Progress = lambda message: None) -> Path | None:
    """Prometheus's UI (``static/mantine-ui``), built with pnpm from the ``web/ui`` of its Go module."""
    dest = prometheus_ui_dir(settings)
    if (dest / ".complete").exists():
        return dest
    npm = _find_npm(settings, "the Prometheus UI")
    go = find_go(settings, PROMETHEUS)
    with _building(dest) as tmp:
        if (dest / ".complete").exists():
            return dest
        log = _log(dest)
        progress(f"building the Prometheus UI ({PROMETHEUS.module}@{PROMETHEUS.version} web/ui) with {PNPM} "
                 f"into {dest} (about 3 min; log {log})")
        ui = tmp / "src"
        shutil.copytree(_module_dir(go, PROMETHEUS, tmp, log) / "web" / "ui", ui,
                        ignore=shutil.ignore_patterns("react-app"))  # the old 2.x UI: not built, not served
        for path in [ui, *ui.rglob("*")]:  # the module cache is read-only
            path.chmod(path.stat().st_mode | 0o200)
        _pin_for_registry(ui / "pnpm-workspace.yaml")
        _run([npm, "install", "--prefix", str(tmp / "pnpm"), "--no-audit", "--no-fund", "--save-exact", PNPM],
             tmp, os.environ, log)
        env = {**os.environ, "PATH": f"{tmp / 'pnpm' / 'node_modules' / '.bin'}{os.pathsep}{os.environ.get('PATH', '')}",
               "CI": ""}
        _run(["pnpm", "install", "--no-frozen-lockfile"], ui, env, log)
        _run(["bash", "build_ui.sh", "--mantine-ui"], ui, env, log)  # upstream's script: modules, then the app
        (ui / "static").rename(tmp / "static")
        shutil.rmtree(ui)
        shutil.rmtree(tmp / "pnpm")
        (tmp / ".complete").write_text(PROMETHEUS.version)
    return dest


def _pin_for_registry(workspace: Path) -> None:
    """Let pnpm resolve ``PROMETHEUS_UI_OVERRIDES`` again: its release-age policy checks every lockfile entry
    against the registry first, and fails on one the registry does not serve before an override can apply.
    Every other entry stays as locked (with its integrity hash)."""
    text = workspace.read_text()
    text = text.replace("minimumReleaseAge: 4320", "minimumReleaseAge: 0")
    text = text.replace("minimumReleaseAgeStrict: true", "minimumReleaseAgeStrict: false")
    lines = [f"  '{name}': {version}" for name, version in PROMETHEUS_UI_OVERRIDES.items()]
    workspace.write_text(text.rstrip("\n") + "\noverrides:\n" + "\n".join(lines) + "\n")


def _module_dir(go: str, program: GoProgram, cwd: Path, log: Path) -> Path:
    """The module's source in Go's module cache (downloaded if a build has not already)."""
    out = _run([go, "mod", "download", "-json", f"{program.module}@{program.version}"], cwd,
               {**os.environ, "GOTOOLCHAIN": "local", "GOFLAGS": ""}, log, capture=True)
    return Path(json.loads(out)["Dir"])


def _find_npm(settings: StackSettings, what: str) -> str:
    found = shutil.which(settings.npm)
    if found is None:
        raise BuildError(f"npm ({settings.npm!r}) not found: it builds {what} once from the npm registry. "
                         "Install Node.js with npm, or set CHATPIPE_NPM")
    return found


# --- building safely --------------------------------------------------------------------------------
def _log(dest: Path) -> Path:
    """The build's log, beside the cache folder (kept when a build fails; started anew by the next)."""
    log = dest.with_name(f"{dest.name}.build.log")
    log.write_text(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} building {dest.name}\n")
    return log


@contextmanager
def _building(dest: Path) -> Iterator[Path]:
    """A fresh temporary folder beside ``dest``, renamed to ``dest`` when the block ends without an
    error (removed otherwise); under a lock per ``dest``, so concurrent builders take turns."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "a") as lock:  # closing it releases the lock
        fcntl.flock(lock, fcntl.LOCK_EX)
        tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            yield tmp
            if tmp.exists() and not dest.exists():
                tmp.rename(dest)
        finally:
            _remove(tmp)


def _remove(path: Path) -> None:
    """Go's module cache and npm leave read-only files; a failed build's folder goes all the same."""
    if not path.exists():
        return
    for item in [path, *path.rglob("*")]:
        if not item.is_symlink():
            item.chmod(item.stat().st_mode | 0o700)
    shutil.rmtree(path, ignore_errors=True)


def _run(cmd: list[str], cwd: Path, env, log: Path, capture: bool = False) -> str:
    """Run one build step at low priority, its output appended to ``log``; a failure names the step and
    ends with the last lines of its output."""
    with open(log, "ab") as out:
        out.write(f"\n$ {' '.join(cmd)}   (in {cwd})\n".encode())
        out.flush()
        proc = subprocess.run(cmd, cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE if capture else out, stderr=out,
                              preexec_fn=lambda: os.nice(10))
    if proc.returncode != 0:
        last = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise BuildError(f"`{' '.join(cmd[:3])} ...` failed (exit {proc.returncode}) in {cwd}:\n{last}")
    return proc.stdout.decode() if capture else ""


# --- building ahead (`make test-prerequisites`, `python -m infra.observability.binaries`) --------------
def build_all(settings: StackSettings, say: Progress = print) -> Installed:
    """``ensure``, saying one line per piece before it is built (name, version, about how long, its log)
    and one when it is done or was found cached: for a build run ahead of the tests (whose output
    pytest hides), so that the long first build on a machine shows."""
    return ensure(settings, say, verbose=True)


def main() -> int:
    say = partial(print, "observability:", flush=True)
    try:
        build_all(StackSettings(), say)
    except BuildError as exc:
        say(f"failed: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
