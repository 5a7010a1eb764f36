"""deploy/jupyterhub/values.yaml against the Zero to JupyterHub chart, and the profiles the
single-server hub derives from it.

What is protected: our values merged over the chart's defaults (as helm merges them) are valid
against the chart's values.schema.yaml, so `helm install` would not refuse them; the three
profiles name their GPU limits (nvidia.com/gpu) and matching WORKBENCH_ defaults; culling,
per-user storage, the notebooks' copy and the quickstart as the lab's first page are there;
the single-server hub reads the same profiles.
"""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml
from hub_profiles import VALUES, find_profile, load_profiles

CHART = Path("/work/shared/reference/z2jh")
ROOT = Path(__file__).resolve().parents[2]


def chart_file(name: str) -> Path:
    """The chart's file: ../shared/reference/z2jh/ next to the checkout (or the path above)."""
    for base in (ROOT.parent / "shared" / "reference" / "z2jh", CHART):
        if (base / name).exists():
            return base / name
    raise FileNotFoundError(f"the Zero to JupyterHub chart's {name}: put the chart's "
                            f"values.yaml and values.schema.yaml in {CHART}")


def merged(base: dict, over: dict) -> dict:
    """``over`` merged into ``base`` as helm merges values files: maps recursively, everything
    else (lists included) replaced."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


@pytest.fixture(scope="module")
def values() -> dict:
    return yaml.safe_load(VALUES.read_text())


def test_values_merged_over_the_chart_defaults_validate_against_its_schema(values):
    schema = yaml.safe_load(chart_file("values.schema.yaml").read_text())
    defaults = yaml.safe_load(chart_file("values.yaml").read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = sorted(validator.iter_errors(merged(defaults, values)), key=str)
    assert not errors, "\n".join(f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors)
    # and the check has teeth: a misspelt key is refused
    bad = merged(defaults, {"singleuser": {"storage": {"capacty": "1Gi"}}})
    assert any("capacty" in e.message for e in validator.iter_errors(bad))


def test_profiles_name_their_gpu_limits_and_workbench_defaults(values):
    profiles = {p["display_name"]: p["kubespawner_override"]
                for p in values["singleuser"]["profileList"]}
    assert list(profiles) == ["CPU (2 cores)", "1 GPU", "8 GPUs"]
    for name, gpus, ranks in (("CPU (2 cores)", None, "2"), ("1 GPU", "1", "1"),
                              ("8 GPUs", "8", "8")):
        override = profiles[name]
        assert override.get("extra_resource_limits", {}).get("nvidia.com/gpu") == gpus, name
        env = override["environment"]
        assert env["WORKBENCH_RANKS"] == ranks and env["WORKBENCH_RANKS_PER_HOST"] == ranks
        assert f"-n {ranks}" in env["WORKBENCH_START_OPTIONS"]
    assert profiles["CPU (2 cores)"]["cpu_limit"] == 2


def test_culling_storage_notebooks_and_first_page(values):
    assert values["cull"]["enabled"] and values["cull"]["timeout"] > 0
    single = values["singleuser"]
    storage = single["storage"]
    assert storage["type"] == "dynamic" and storage["capacity"]
    copy_cmd = " ".join(single["lifecycleHooks"]["postStart"]["exec"]["command"])
    assert "cp -rn" in copy_cmd and storage["homeMountPath"] in copy_cmd
    first = single["defaultUrl"]
    assert first.startswith("/lab/tree/") and first.endswith("00_quickstart.ipynb")
    assert (ROOT / "notebooks" / Path(first).name).exists()
    assert single["image"]["name"] and isinstance(single["image"]["tag"], str)


def test_the_single_server_hub_offers_the_same_profiles(values):
    profiles = load_profiles()
    assert [p.display_name for p in profiles] == [
        p["display_name"] for p in values["singleuser"]["profileList"]]
    assert [p.gpus for p in profiles] == [0, 1, 8]
    assert find_profile(profiles, None).slug == "cpu"  # the default
    assert find_profile(profiles, "1 GPU").slug == "gpu-1"
    assert find_profile(profiles, "gpu-8").environment["WORKBENCH_RANKS"] == "8"
    with pytest.raises(ValueError, match="unknown profile 'gpu-4': choose one of 'cpu'"):
        find_profile(profiles, "gpu-4")
