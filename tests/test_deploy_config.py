"""Deploy config YAML: a malformed file is an InvalidRequestError (param deploy_config) that
says what is wrong, never an AttributeError or TypeError from inside the parser."""

from __future__ import annotations

import pytest

from omnistage.deploy import DeployConfig, StagePlacement
from omnistage.errors import InvalidRequestError


def _load(tmp_path, text: str) -> DeployConfig:
    path = tmp_path / "deploy.yaml"
    path.write_text(text)
    return DeployConfig.from_yaml(path)


@pytest.mark.parametrize("text, why", [
    ("- talker\n- token2wav\n", r"must be a mapping with a 'stages' key .*got a list"),
    ("just a string\n", r"must be a mapping with a 'stages' key .*got a string"),
    ("42\n", r"must be a mapping with a 'stages' key .*got a number"),
    ("stages: [talker, token2wav]\n", r"'stages' must be a mapping .*got a list"),
    ("stages: process\n", r"'stages' must be a mapping .*got a string"),
    ("stages: {}\nworkers: 3\n", r"unknown keys \['workers'\]; the keys are 'stages' and 'ray'"),
    ("ray: {adress: auto}\n", r"'ray' must be a mapping with keys address, bind_host"),
    ("ray: [auto]\n", r"'ray' must be a mapping with keys address, bind_host"),
    ("ray: {address: 5}\n", r"ray.address must be a string"),
    ("stages:\n  talker: {where: process, num_cpus: 2}\n", r"num_cpus apply to where: ray only"),
    ("stages:\n  talker: {where: ray, num_gpus: -1}\n", r"num_gpus must be a number >= 0"),
    ("stages:\n  talker: {where: ray, num_cpus: two}\n", r"num_cpus must be a number >= 0"),
    ("stages:\n  talker: {where: ray, resources: [node_b]}\n", r"resources must map resource names"),
    ("stages:\n  talker: {where: ray, resources: {node_b: 0}}\n", r"resources must map resource names"),
    ("stages:\n  talker: {where: ray, model_path: 3}\n", r"model_path must be a path"),
    ("stages:\n  talker: {where: ray, start_timeout_s: 0}\n", r"start_timeout_s must be a number"),
    ("stages:\n  talker: {where: ray, spread: always}\n", r"spread must be best_effort or strict"),
    ("stages:\n  talker: {where: ray, spread: strict}\n", r"needs where: ray and replicas >= 2"),
    ("stages:\n  talker: process\n", r"stages.talker must be a mapping .*got a string"),
    ("stages:\n  talker: [process]\n", r"stages.talker must be a mapping .*got a list"),
    ("stages:\n  talker: {where: process, colour: red}\n",
     r"stages.talker has unknown keys \['colour'\]; its keys are where, num_threads, replicas, "
     r"num_cpus, num_gpus, resources, model_path, start_timeout_s, spread"),
    ("stages:\n  1: {where: process}\n", r"stage names must be strings, got 1"),
    ("stages:\n  talker: {where: [process]}\n", r"where must be one of"),
    ("stages:\n  talker: {where: process, num_threads: many}\n", r"num_threads must be a positive"),
    ("stages:\n  talker: {where: process, num_threads: 0}\n", r"num_threads must be a positive"),
    ("stages:\n  talker: {where: process, replicas: true}\n", r"replicas must be a positive"),
    ("stages: {talker: {where: process}\n", r"cannot read deploy config"),     # not YAML
])
def test_malformed_configs_say_what_is_wrong(tmp_path, text, why):
    with pytest.raises(InvalidRequestError, match=why) as e:
        _load(tmp_path, text)
    assert e.value.param == "deploy_config"


def test_a_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(InvalidRequestError, match="cannot read deploy config") as e:
        DeployConfig.from_yaml(tmp_path / "nope.yaml")
    assert e.value.param == "deploy_config"


@pytest.mark.parametrize("text", ["", "stages:\n", "stages: {}\n"])
def test_empty_configs_place_every_stage_here(tmp_path, text):
    assert _load(tmp_path, text).stages == {}


def test_a_valid_config(tmp_path):
    config = _load(tmp_path, "stages:\n  token2wav: {where: process, replicas: 2, num_threads: 1}\n"
                             "  talker: {where: ray}\n  thinker:\n")
    assert config.stages == {"token2wav": StagePlacement("process", num_threads=1, replicas=2),
                             "talker": StagePlacement("ray"), "thinker": StagePlacement()}


def test_a_ray_cluster_config(tmp_path):
    from omnistage.deploy import RayCluster

    config = _load(tmp_path, "ray: {address: auto, bind_host: 10.0.0.1}\nstages:\n"
                             "  talker: {where: ray, num_cpus: 2, resources: {node_b: 1}, replicas: 2,"
                             " model_path: /mnt/m, start_timeout_s: 30}\n")
    assert config.ray == RayCluster("auto", "10.0.0.1")
    talker = config.stages["talker"]
    assert talker.ray_options() == {"num_cpus": 2, "resources": {"node_b": 1},
                                    "scheduling_strategy": "SPREAD"}
    assert (talker.model_path, talker.start_timeout_s) == ("/mnt/m", 30)
    assert StagePlacement("ray").ray_options() == {"num_cpus": 0}
