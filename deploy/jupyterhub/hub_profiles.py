"""The playground's profiles ("CPU (2 cores)", "1 GPU", "8 GPUs"), read from ``values.yaml``.

Why it exists: the Kubernetes deployment (values.yaml's ``singleuser.profileList``) and the
single-server hub (jupyterhub_config.py) must offer the same choices with the same
``WORKBENCH_`` defaults. values.yaml is the one place they are written; this module turns its
profile list into what a local spawner needs: how many GPUs, which environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

VALUES = Path(__file__).with_name("values.yaml")
GPU_RESOURCE = "nvidia.com/gpu"


@dataclass(frozen=True)
class Profile:
    slug: str
    display_name: str
    description: str
    gpus: int  # the nvidia.com/gpu limit; 0 for CPU only
    cpu_limit: float | None
    environment: dict[str, str] = field(default_factory=dict)
    default: bool = False


def load_profiles(values: Path = VALUES) -> list[Profile]:
    """The profiles of ``values`` (a Zero to JupyterHub values file), in its order."""
    import yaml  # PyYAML: in the hub's environment through jupyterhub's own dependencies

    doc = yaml.safe_load(Path(values).read_text())
    entries = (doc.get("singleuser") or {}).get("profileList") or []
    if not entries:
        raise ValueError(f"{values}: singleuser.profileList is empty; list the profiles there")
    profiles = []
    for entry in entries:
        override = entry.get("kubespawner_override") or {}
        limits = override.get("extra_resource_limits") or {}
        profiles.append(Profile(
            slug=entry["slug"],
            display_name=entry["display_name"],
            description=entry.get("description", ""),
            gpus=int(limits.get(GPU_RESOURCE, 0)),
            cpu_limit=override.get("cpu_limit"),
            environment={k: str(v) for k, v in (override.get("environment") or {}).items()},
            default=bool(entry.get("default", False)),
        ))
    return profiles


def find_profile(profiles: list[Profile], slug: str | None) -> Profile:
    """The profile named ``slug`` (its slug or display name); the default one for ``None``."""
    if not slug:
        return next((p for p in profiles if p.default), profiles[0])
    for p in profiles:
        if slug in (p.slug, p.display_name):
            return p
    names = ", ".join(repr(p.slug) for p in profiles)
    raise ValueError(f"unknown profile {slug!r}: choose one of {names}")
