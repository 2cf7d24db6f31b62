"""Where the package finds libmarconi: $MARCONI_LIBRARY (which must exist),
else the library pip bundled into the package directory, else
$CARGO_TARGET_DIR/release, else target/release above the package or the
working directory."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import marconi
from conftest import REPO

PROBE = "import marconi; print(marconi.library_path()); print(marconi.version())"
PACKAGE = Path(marconi.__file__).resolve().parent
FROM_SOURCE = PACKAGE == (REPO / "python-shim" / "marconi").resolve()
"""The tests run against the source tree (PYTHONPATH=python-shim), not an
installed package: there is nothing bundled to check."""


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("MARCONI_LIBRARY", "CARGO_TARGET_DIR")}
    env.update(extra)
    return env


def run(env, cwd="/"):
    r = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, cwd=cwd, check=False)
    return r


@pytest.mark.skipif(FROM_SOURCE, reason="marconi is imported from the source tree, not an installed package")
def test_installed_package_loads_its_bundled_library():
    # As a user runs it: no environment variable, from anywhere.
    r = run(clean_env())
    assert r.returncode == 0, r.stderr
    found, version = r.stdout.split()
    assert Path(found).parent == PACKAGE, f"{found} is not bundled in {PACKAGE}"
    assert Path(found).name.startswith("libmarconi")
    assert version == marconi.version()


def test_explicit_path_must_exist():
    r = run(clean_env(MARCONI_LIBRARY="/nonexistent/libmarconi.so"))
    assert r.returncode != 0 and "MARCONI_LIBRARY=/nonexistent/libmarconi.so does not exist" in r.stderr


def test_explicit_path_overrides_the_bundled_library(tmp_path):
    copy = tmp_path / "libmarconi-copy.so"
    shutil.copyfile(marconi.library_path(), copy)
    r = run(clean_env(MARCONI_LIBRARY=str(copy)))
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.split()[0]) == copy


def test_cargo_target_dir_fallback(tmp_path):
    # The package's Python files without a bundled library, and a target dir
    # holding the library.
    pkg = tmp_path / "src" / "marconi"
    pkg.mkdir(parents=True)
    for f in PACKAGE.glob("*.py"):
        shutil.copyfile(f, pkg / f.name)
    lib = tmp_path / "target-elsewhere" / "release" / "libmarconi.so"
    lib.parent.mkdir(parents=True)
    shutil.copyfile(marconi.library_path(), lib)
    env = clean_env(CARGO_TARGET_DIR=str(lib.parent.parent), PYTHONPATH=str(pkg.parent))
    r = run(env)
    assert r.returncode == 0, r.stderr
    found, version = r.stdout.split()
    assert Path(found) == lib and version == marconi.version()
    # Without it, nothing is found, and the message says how to get one.
    r = run(clean_env(PYTHONPATH=str(pkg.parent)), cwd=str(tmp_path))
    assert r.returncode != 0 and "pip install ./python-shim" in r.stderr
