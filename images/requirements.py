"""Print the requirements of an image's bubbles install, one per line: the base install's and those of the extras
named (an extra naming other extras of bubbles brings theirs). The Dockerfiles install these in a layer of their own
before the code is copied, so a build after a change to the code alone reuses that layer (docker and podman cache
layers; buildah does with --layers or BUILDAH_LAYERS=true) instead of installing every dependency again.

    python3 images/requirements.py operator > requirements.txt

Standard library only: it runs on the image's base, before anything is installed.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path


def requirements(pyproject: dict, extras: list[str]) -> list[str]:
    project = pyproject["project"]
    optional = project.get("optional-dependencies", {})
    self_ref = re.compile(rf"^{re.escape(project['name'])}\[([^\]]+)\]$")
    out: list[str] = list(project.get("dependencies", []))
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop(0)
        if extra in seen:
            continue
        if extra not in optional:
            raise ValueError(f"no extra {extra!r} in pyproject.toml; its extras: {', '.join(sorted(optional))}")
        seen.add(extra)
        for req in optional[extra]:
            match = self_ref.match(req.replace(" ", ""))
            if match:
                todo += [e.strip() for e in match.group(1).split(",")]
            else:
                out.append(req)
    return list(dict.fromkeys(out))


def main(argv: list[str]) -> int:
    if not argv or any(a.startswith("-") for a in argv):
        print("usage: python3 images/requirements.py EXTRA... (from the directory holding pyproject.toml)",
              file=sys.stderr)
        return 2
    path = Path("pyproject.toml")
    if not path.is_file():
        print(f"images/requirements.py: no pyproject.toml in {Path.cwd()}: run it where the project's is",
              file=sys.stderr)
        return 2
    try:
        print("\n".join(requirements(tomllib.loads(path.read_text()), argv)))
    except ValueError as exc:
        print(f"images/requirements.py: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
