"""Print the third-party requirements of pyproject.toml's project and the extras named, one a line:
the images install these in a layer of their own before any source is copied, so a change to the
code rebuilds seconds of image, not minutes of dependencies.

    python3 requirements.py pyproject.toml trainer,local > /tmp/requirements.txt
"""

import sys
import tomllib


def requirements(pyproject: str, extras: str) -> list[str]:
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    wanted = [e for e in extras.split(",") if e]
    unknown = set(wanted) - set(project["optional-dependencies"])
    if unknown:
        raise SystemExit(f"{pyproject} has no extra {sorted(unknown)}")
    return project["dependencies"] + [
        r for e in wanted for r in project["optional-dependencies"][e]
    ]


if __name__ == "__main__":
    extras = sys.argv[2] if len(sys.argv) > 2 else ""
    sys.stdout.write("".join(f"{r}\n" for r in requirements(sys.argv[1], extras)))
