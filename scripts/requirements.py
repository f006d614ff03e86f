#!/usr/bin/env python3
"""The requirements of kvstore's extras, read from pyproject.toml (no kvstore import): what an image
installs before the wheel, so that a code change does not reinstall every dependency.

    python scripts/requirements.py directory            # the base dependencies + the directory's
    python scripts/requirements.py worker connector     # several extras at once
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def requirements(extras: list[str]) -> list[str]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    optional = project["optional-dependencies"]
    unknown = sorted(set(extras) - set(optional))
    if unknown:
        raise SystemExit(f"unknown extras {unknown}; pyproject.toml has {sorted(optional)}")
    out, todo, seen = list(project["dependencies"]), list(extras), set()
    while todo:
        extra = todo.pop(0)
        if extra in seen:
            continue
        seen.add(extra)
        for req in optional[extra]:
            inner = re.fullmatch(r"kvstore\[([\w,\s-]+)\]", req)
            if inner:  # kvstore[connector]: that extra's requirements, not the package itself
                todo += [e.strip() for e in inner.group(1).split(",")]
            elif req not in out:
                out.append(req)
    return out


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1:])))
