import pytest
import yaml

from eqc_utils.params import ParamsError, load_params, parse_override
from eqc_utils.paths import PARAMS_DIR


def write_profile(tmp_path, mutate):
    raw = yaml.safe_load((PARAMS_DIR / "tiny.yaml").read_text())
    mutate(raw)
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("profile", sorted(p.stem for p in PARAMS_DIR.glob("*.yaml")))
def test_every_shipped_profile_validates(profile):
    params = load_params(profile)
    assert params["profile"] == profile


def test_unknown_key_names_file_and_key(tmp_path):
    path = write_profile(tmp_path, lambda r: r["prompts"].update(oversampel=1.2))
    with pytest.raises(ParamsError, match=r"broken\.yaml.*unknown key 'prompts\.oversampel'"):
        load_params(str(path))


def test_wrong_type_names_key_and_expected_type(tmp_path):
    path = write_profile(tmp_path, lambda r: r["prompts"].update(shuffle_seed="zero"))
    with pytest.raises(ParamsError, match=r"broken\.yaml.*'prompts\.shuffle_seed' expects integer, got str"):
        load_params(str(path))


def test_missing_key_is_reported(tmp_path):
    path = write_profile(tmp_path, lambda r: r["prompts"].pop("oversample"))
    with pytest.raises(ParamsError, match=r"missing key 'prompts\.oversample'"):
        load_params(str(path))


def test_enum_and_nested_quota_types(tmp_path):
    path = write_profile(tmp_path, lambda r: r["prompts"].update(source="web"))
    with pytest.raises(ParamsError, match=r"'prompts\.source' expects one of 'local', 'nemotron'"):
        load_params(str(path))
    path = write_profile(tmp_path, lambda r: r["prompts"]["stage2_quotas"].update(chat=1.5))
    with pytest.raises(ParamsError, match=r"'prompts\.stage2_quotas\.chat' expects integer"):
        load_params(str(path))


def test_cli_overrides_are_parsed_typed_and_validated():
    assert parse_override("prompts.oversample=1.5") == ("prompts.oversample", 1.5)
    assert parse_override("qad.lr=1e-5") == ("qad.lr", 1e-5)
    assert parse_override("prompts.default_system_prompt=Be brief.") == ("prompts.default_system_prompt", "Be brief.")
    params = load_params("tiny", ["prompts.oversample=2", "prompts.manifest=null"])
    assert params["prompts"]["oversample"] == 2.0 and isinstance(params["prompts"]["oversample"], float)
    with pytest.raises(ParamsError, match="unknown key 'prompts.nope'"):
        load_params("tiny", ["prompts.nope=1"])
    with pytest.raises(ParamsError, match="expects integer"):
        load_params("tiny", {"seed": "x"})
    with pytest.raises(ParamsError, match="KEY=VALUE"):
        load_params("tiny", ["seed"])


def test_unknown_profile_lists_known_ones():
    with pytest.raises(ParamsError, match="known profiles: .*tiny"):
        load_params("nonexistent")
