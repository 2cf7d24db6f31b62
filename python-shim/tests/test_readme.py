"""The README's Python snippet runs and prints what the README says."""

import re
import subprocess
import sys

from conftest import REPO


def section_block(text: str, section: str, lang: str) -> str:
    body = text.split(f"\n## {section}\n", 1)[1]
    return re.search(rf"```{lang}\n(.*?)```", body, flags=re.S).group(1)


def test_readme_python_snippet():
    readme = (REPO / "README.md").read_text()
    code = section_block(readme, "Python", "python")
    expected = section_block(readme, "Python", "text")
    # A fresh interpreter, as a reader would run it (lease ids depend on how
    # many caches the process made before, so the snippet runs alone).
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out == expected
