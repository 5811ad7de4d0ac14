from pathlib import Path

import pytest
import yaml

from kpipe.infra.config import ConfigError, deep_merge, load_config, load_schema, validate_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def schema():
    return load_schema()


def default_config():
    return yaml.safe_load((ROOT / "config" / "config.yaml").read_text())


def test_default_and_paper_configs_validate(schema):
    for name in ["config.yaml", "paper.yaml"]:
        cfg = yaml.safe_load((ROOT / "config" / name).read_text())
        validate_config(cfg, schema)


def test_defaults_are_filled(schema):
    cfg = {"queries": {"sources": [{"name": "kb", "kind": "kernelbench"}]}}
    validate_config(cfg, schema)
    assert cfg["run"] == "default"
    assert cfg["kernelbench"]["version"] == "main"
    assert cfg["queries"]["decontamination"] == {"mode": "drop", "threshold": 0.8}
    assert cfg["queries"]["sources"][0]["levels"] == [1, 2]


@pytest.mark.parametrize(
    "patch, expected",
    [
        ({"kernelbench": {"versoin": "main"}}, "config error: kernelbench.versoin: unknown key"),
        ({"kernelbench": {"levels": [4]}}, "config error: kernelbench.levels.0: 4 is not one of [1, 2, 3]"),
        ({"device": "gpu"}, "config error: device: 'gpu' is not one of"),
        ({"queries": {"decontamination": {"threshold": "high"}}}, "config error: queries.decontamination.threshold: 'high' is not of type 'number'"),
        ({"bogus": 1}, "config error: bogus: unknown key"),
        ({"gym": {"protocol": {"reject_findings": ["thread", "cuda_streams"]}}},
         "config error: gym.protocol.reject_findings.1: 'cuda_streams' is not one of"),
    ],
)
def test_bad_config_gives_one_line_naming_the_key(schema, patch, expected):
    cfg = deep_merge(default_config(), patch)
    with pytest.raises(ConfigError) as info:
        validate_config(cfg, schema)
    message = str(info.value)
    assert message.startswith(expected), message
    assert "\n" not in message


def test_missing_source_kind_is_named(schema):
    cfg = default_config()
    del cfg["queries"]["sources"][0]["kind"]
    with pytest.raises(ConfigError, match=r"queries.sources.0: 'kind' is a required property"):
        validate_config(cfg, schema)


def test_overlays_merge_deeply(tmp_path, schema):
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("kernelbench:\n  size_cap: 32\n")
    cfg = load_config(ROOT / "config" / "config.yaml", overlay, schema=schema)
    assert cfg["kernelbench"]["size_cap"] == 32
    assert cfg["kernelbench"]["ids"] == default_config()["kernelbench"]["ids"]


def test_deep_merge_does_not_alias():
    base = {"a": {"b": [1]}}
    merged = deep_merge(base, {"a": {"c": 2}})
    merged["a"]["b"].append(2)
    assert base == {"a": {"b": [1]}}
    assert merged == {"a": {"b": [1, 2], "c": 2}}


def test_key_order_does_not_matter(schema):
    a = validate_config({"queries": {"sources": [{"name": "kb", "kind": "kernelbench"}]}, "kernelbench": {"version": "v0", "levels": [1]}}, schema)
    b = validate_config({"kernelbench": {"levels": [1], "version": "v0"}, "queries": {"sources": [{"kind": "kernelbench", "name": "kb"}]}}, schema)
    assert repr(a) == repr(b)


def test_every_protocol_field_can_be_set_in_the_config(schema):
    """`gym.protocol` accepts exactly kpipe.gym.Protocol's fields (its version comes from the code)."""
    import dataclasses

    from kpipe.gym.protocol import Protocol

    fields = {f.name for f in dataclasses.fields(Protocol)} - {"version"}
    assert set(schema["properties"]["gym"]["properties"]["protocol"]["properties"]) == fields


def test_reject_findings_are_the_screens_codes_in_the_schema_and_the_protocol(schema):
    """A misspelt code would reject nothing; the schema, the protocol and the screen agree on the list."""
    from kpipe.gym.protocol import Protocol
    from kpipe.gym.protocol import FINDING_CODES

    item = schema["properties"]["gym"]["properties"]["protocol"]["properties"]["reject_findings"]["items"]
    assert item["enum"] == list(FINDING_CODES)
    with pytest.raises(ValueError, match="reject_findings names no screen finding: cuda_streams"):
        Protocol(reject_findings=("thread", "cuda_streams"))
    with pytest.raises(ValueError, match="names no screen finding"):
        Protocol.from_dict({"reject_findings": ["monkeypatch"]})
    assert Protocol(reject_findings=FINDING_CODES).reject_findings == FINDING_CODES


def test_nested_command_line_strings_are_read_as_yaml():
    """Snakemake leaves the values of `--config kernelbench='{"size_cap": 128}'` strings."""
    from kpipe.infra.config import parse_nested_strings

    assert parse_nested_strings({"size_cap": "128", "ids": {"level_1": ["19", "23"]}, "version": "main", "x": "null"}) == {
        "size_cap": 128, "ids": {"level_1": [19, 23]}, "version": "main", "x": None}


def test_range_errors_say_range(schema):
    cfg = deep_merge(default_config(), {"rl": {"iterations": -2}})
    with pytest.raises(ConfigError, match=r"^config error: rl.iterations: out of range: -2 is less than the minimum of 1$"):
        validate_config(cfg, schema)


def test_an_exponent_without_a_dot_says_why_it_is_text(schema):
    """`--config 'sft={"lr": 1e-12}'` (or `lr: 1e-12` in a file): YAML 1.1 reads 1e-12 as a string."""
    from kpipe.infra.config import parse_nested_strings

    cfg = deep_merge(default_config(), parse_nested_strings({"sft": {"lr": "1e-12"}}))
    with pytest.raises(ConfigError, match=r"^config error: sft.lr: '1e-12' is not of type 'number': YAML reads a number "
                                          r"with an exponent but no dot as text; write 1.0e-12$"):
        validate_config(cfg, schema)


def leaves(value: object, prefix: str = "") -> dict[str, object]:
    """Every leaf of a nested config as dotted key -> value (an empty mapping is a leaf)."""
    if isinstance(value, dict) and value:
        return {key: leaf for name, item in value.items() for key, leaf in leaves(item, f"{prefix}{name}.").items()}
    return {prefix.rstrip("."): value}


@pytest.mark.parametrize("overlays", [["paper.yaml"], ["paper.yaml", "paper_14b.yaml"]])
def test_paper_configs_layered_over_the_default_inherit_nothing_from_it(schema, overlays):
    """Snakemake layers --configfile files over config/config.yaml (mappings merge, lists replace):
    the paper's run must be what its files say, not the small offline run's selection and sizes."""
    paths = [ROOT / "config" / name for name in overlays]
    alone = leaves(load_config(*paths, schema=schema))
    layered = leaves(load_config(ROOT / "config" / "config.yaml", *paths, schema=schema))
    unused = {"policy.tiny.size", "policy.tiny.tokenizer"}  # read only when policy.base_model is tiny
    differ = {key for key in alone.keys() | layered.keys() if alone.get(key, "absent") != layered.get(key, "absent")}
    assert differ == unused


def test_null_ids_keep_every_problem(schema):
    """An overlay drops a lower file's `ids` with null: an empty mapping would merge into them."""
    cfg = deep_merge(default_config(), {"kernelbench": {"ids": None}})
    assert validate_config(cfg, schema)["kernelbench"]["ids"] is None


def test_the_gpu_overlay_changes_only_sizes_trials_batch_and_slots(schema):
    """config/gpu.yaml over the default run: KernelBench's own sizes, the protocol's trial counts, one
    generation batch per RL step, 8 slots per GPU, device cuda; every other value is the default run's."""
    default = leaves(load_config(ROOT / "config" / "config.yaml", schema=schema))
    gpu = leaves(load_config(ROOT / "config" / "config.yaml", ROOT / "config" / "gpu.yaml", schema=schema))
    changed = {key: gpu[key] for key in gpu if gpu[key] != default.get(key, "absent") and key != "queries.sources"}
    assert changed == {"device": "cuda", "kernelbench.size_cap": None, "gym.protocol.correct_trials": 5,
                       "gym.protocol.perf_trials": 100, "gym.protocol.warmup": 10, "rl.generation_batch_size": 64,
                       "gpu.slots_per_gpu": 8}
    sources = load_config(ROOT / "config" / "config.yaml", ROOT / "config" / "gpu.yaml", schema=schema)["queries"]["sources"]
    default_sources = load_config(ROOT / "config" / "config.yaml", schema=schema)["queries"]["sources"]
    assert sources == [{**source, "size_cap": None} for source in default_sources]
