"""Where the package finds libmarconi: $MARCONI_LIBRARY (which must exist),
else the package directory, else $CARGO_TARGET_DIR/release."""

import os
import subprocess
import sys
from pathlib import Path

import marconi

PROBE = "import marconi; print(marconi.library_path()); print(marconi.version())"


def run(env):
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, cwd="/")


def test_explicit_path_must_exist():
    env = dict(os.environ, MARCONI_LIBRARY="/nonexistent/libmarconi.so")
    r = run(env)
    assert r.returncode != 0 and "MARCONI_LIBRARY=/nonexistent/libmarconi.so does not exist" in r.stderr


def test_cargo_target_dir_fallback():
    lib = marconi.library_path().resolve()
    env = {k: v for k, v in os.environ.items() if k != "MARCONI_LIBRARY"}
    env["CARGO_TARGET_DIR"] = str(lib.parent.parent)  # .../target, the lib is in release/
    r = run(env)
    assert r.returncode == 0, r.stderr
    found, version = r.stdout.split()
    assert Path(found).resolve() == lib
    assert version == marconi.version()
