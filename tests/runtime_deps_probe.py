"""Serve every built-in `tiny:` model with only omnistage's runtime dependencies installed
(what the README's `pip install -e .` brings, not the `[test]` extra).

`runtime_site(folder)` mirrors this environment's site-packages into `folder` (symlinks)
without the distributions outside the runtime closure of omnistage's requirements (read from
the installed metadata): their modules and their dist-info are absent, as if never installed.
Run as a script under `python -S` with PYTHONPATH=folder:REPO, it loads each family through
`Omni` and, for one model of each kind, asks for one small answer; prints `OK <arch>` per
family; any failure exits non-zero.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

GENERATE = ("qwen2", "qwen2_5_omni", "qwen_image", "wan")   # one answer each; the rest load


def runtime_closure(root: str = "omnistage") -> set[str]:
    """Normalised names of `root` and every distribution its runtime requirements pull in."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    seen, todo = set(), [root]
    while todo:
        name = _norm(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.distribution(name).requires or []
        except md.PackageNotFoundError:
            continue
        for spec in requires:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def runtime_site(folder: Path) -> list[str]:
    """Link every top-level entry of site-packages into `folder` except those that only
    distributions outside the runtime closure installed; -> the left-out distributions."""
    import importlib.metadata as md
    import site as site_module

    allowed = runtime_closure()
    sites = {Path(s).resolve() for s in site_module.getsitepackages()}
    owned: dict[tuple[Path, str], set[bool]] = {}    # (site dir, top entry) -> allowed owners?
    left_out = []
    for dist in md.distributions():
        ok = _norm(dist.metadata["Name"]) in allowed
        if not ok:
            left_out.append(dist.metadata["Name"])
        site = Path(dist.locate_file("")).resolve()
        if site not in sites:       # omnistage itself, from the repo (PYTHONPATH)
            continue
        for f in dist.files or []:
            top = f.parts[0]
            if top != ".." and not top.endswith(".pth"):
                owned.setdefault((site, top), set()).add(ok)
    folder.mkdir(parents=True, exist_ok=True)
    for site in sites:
        for entry in site.iterdir():
            owners = owned.get((site, entry.name))
            if entry.suffix == ".pth" or (owners is not None and True not in owners):
                continue           # a .pth (site is off) or only left-out distributions' files
            link = folder / entry.name
            if not link.exists():
                link.symlink_to(entry)
    return sorted(left_out)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def serve(arch: str) -> None:
    from omnistage import Omni, SamplingParams
    from omnistage.diffusion.params import DiffusionParams
    from omnistage.engine_api import OutputOptions
    from omnistage.entrypoints.model_source import tiny_checkpoint

    with Omni(str(tiny_checkpoint(arch))) as omni:
        if arch not in GENERATE:
            return
        can = omni.engine.abilities
        if can.makes_pixels:
            frames = {"num_frames": 5} if can.generates == "video" else {}
            [out] = omni.generate("a cat", DiffusionParams(num_inference_steps=2, seed=0, **frames))
            assert out.pixels, arch
        else:
            speech = OutputOptions(modalities=["text", "audio"] if can.audio_output else ["text"])
            [out] = omni.generate([{"role": "user", "content": "Hi"}],
                                  SamplingParams(max_tokens=4), output=speech)
            assert out.token_ids, arch


if __name__ == "__main__":
    for arch in sys.argv[1:]:
        serve(arch)
        print("OK", arch, flush=True)
