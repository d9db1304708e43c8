"""Checks the built distributions in a folder: the wheel installs one top-level package, ``constrain``,
with ``constrain.sampler``, ``constrain.grammars`` (and its ``.ebnf`` files) and ``py.typed`` inside it.

Usage: ``python .ci/check_wheel.py dist`` (exit status 1 and one line per problem).
"""

from __future__ import annotations

import pathlib
import sys
import tarfile
import zipfile


def problems(folder: pathlib.Path) -> list[str]:
    wheels = sorted(folder.glob("constrain_llm-*.whl"))
    sdists = sorted(folder.glob("constrain_llm-*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        return [f"expected one wheel and one sdist of constrain-llm in {folder}, found {wheels + sdists}"]
    names = zipfile.ZipFile(wheels[0]).namelist()
    out = []
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    if top != {"constrain"}:
        out.append(f"the wheel installs top-level names {sorted(top)}; only 'constrain' is ours to claim")
    for needed in ("constrain/py.typed", "constrain/sampler/__init__.py", "constrain/sampler/ops/bitmask.py",
                   "constrain/grammars/__init__.py", "constrain/grammars/json.ebnf"):  # fmt: skip
        if needed not in names:
            out.append(f"the wheel lacks {needed}")
    with tarfile.open(sdists[0]) as sdist:
        links = [m.name for m in sdist.getmembers() if m.issym() or m.islnk()]
        if links:
            out.append(f"the sdist holds links, which not every installer follows: {links}")
    return out


if __name__ == "__main__":
    found = problems(pathlib.Path(sys.argv[1]))
    print("\n".join(found) or "wheel: one top-level package, constrain, with its sampler and grammars")
    sys.exit(1 if found else 0)
