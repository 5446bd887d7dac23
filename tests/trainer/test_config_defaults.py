"""Every default is written once, in the dataclasses: configs/config.yaml and the groups' presets list only what
they change, and every preset composes onto the defaults to exactly its schema plus what it lists."""
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from trainer.config import CONFIG_DIR, GROUP_SCHEMAS, Config, load_config

# config.yaml's own keys, which no schema has: the presets it picks, and Hydra's settings.
HYDRA_KEYS = ("defaults", "hydra")
# configs/experiment/ (comparison grids, scripts/experiments.py) and configs/eval/tasks/ (lm_eval's task files)
# are not composed onto a schema.
PRESETS = [path for group in GROUP_SCHEMAS for path in sorted((CONFIG_DIR / group).glob("*.yaml"))]
FILES = [CONFIG_DIR / "config.yaml", *PRESETS]


def leaves(mapping: dict, prefix: str = ""):
    """(dotted key, value) of every leaf of a nested mapping; a list is one value."""
    for key, value in mapping.items():
        if isinstance(value, dict):
            yield from leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


# Every default as the composed config holds it: Config's, with the residual options as their own group.
DEFAULTS = dict(leaves({**OmegaConf.to_container(OmegaConf.structured(Config)),
                        "variant": OmegaConf.to_container(OmegaConf.structured(GROUP_SCHEMAS["variant"]))}))


def listed(path) -> dict:
    """The file's leaves under the keys they set in the composed config (a preset's under its group)."""
    prefix = "" if path.parent == CONFIG_DIR else f"{path.parent.name}."
    values = OmegaConf.to_container(OmegaConf.load(path))
    values.pop("defaults", None)  # a preset's picks of other groups' presets (variant_picked)
    return {key: value for key, value in leaves(values, prefix) if key.split(".")[0] not in HYDRA_KEYS}


def test_every_group_has_presets():
    assert {path.parent.name for path in PRESETS} == set(GROUP_SCHEMAS)


@pytest.mark.parametrize("path", FILES, ids=lambda path: str(path.relative_to(CONFIG_DIR)))
def test_no_file_restates_a_default(path):
    restated = [f"{key}={value!r}" for key, value in listed(path).items()
                if key in DEFAULTS and value == DEFAULTS[key]]
    assert not restated, f"{path.relative_to(CONFIG_DIR)} restates the schema's default: {', '.join(restated)}"


@pytest.mark.parametrize("path", PRESETS, ids=lambda path: str(path.relative_to(CONFIG_DIR)))
def test_every_preset_composes_to_its_schema_plus_what_it_lists(path):
    group = path.parent.name
    composed = OmegaConf.structured(load_config([f"{group}={path.stem}"]))
    section = OmegaConf.to_container(OmegaConf.select(composed, "model.residual" if group == "variant" else group))
    schema = {key: value for key, value in DEFAULTS.items() if key.startswith(f"{group}.")}
    assert dict(leaves(section, f"{group}.")) == {**schema, **listed(path), **variant_picked(path)}


def variant_picked(path) -> dict:
    """The leaves of the variant preset a model preset picks in its defaults list (model=kimi_k3 picks
    variant=kimi_k3), under model.residual where the trainer keeps them."""
    picked = [choice for entry in OmegaConf.load(path).get("defaults", []) for choice in entry.values()]
    return {key.replace("variant.", "model.residual.", 1): value
            for choice in picked for key, value in listed(CONFIG_DIR / "variant" / f"{choice}.yaml").items()}


@pytest.mark.slow
def test_the_schemas_are_registered_by_loading_a_config_not_by_importing_it():
    check = ("from hydra.core.config_store import ConfigStore; import trainer.config as c; "
             "store = ConfigStore.instance().repo; print('schema' in store); c.load_config([]); print('schema' in store)")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "True"]
