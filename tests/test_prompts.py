"""Manifest rebuild and the deterministic sampler on a synthetic Nemotron-format parquet fixture
(the real dataset is gated)."""
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eqc_utils import prompts
from eqc_utils.prompts import NemotronShards, PromptSourceError, SamplerConfig


def make_shards(root, rows_per_split=40, shards=2):
    data = root / "data"
    data.mkdir(parents=True)
    for split in ("chat", "math", "code"):
        for s in range(shards):
            rows = []
            for i in range(rows_per_split):
                n = s * rows_per_split + i
                text = f"{split} question {n % (rows_per_split * shards - 5)}"  # a few duplicated user texts
                messages = [{"role": "user", "content": text}, {"role": "assistant", "content": "old answer"}]
                if n % 7 == 0:
                    messages = [{"role": "system", "content": ""}] + messages
                if n % 11 == 0:
                    messages = [{"role": "assistant", "content": "no user turn"}]
                rows.append({"uuid": f"{split}-{n:04d}", "category": split, "reasoning": "on" if n % 2 else "off",
                             "messages": messages})
            pq.write_table(pa.Table.from_pylist(rows), data / f"{split}-{s:05d}-of-{shards:05d}.parquet")
    return root


def test_to_prompt_rules():
    conv = prompts.to_prompt([{"role": "system", "content": ""}, {"role": "user", "content": "hi"},
                              {"role": "assistant", "content": "a"}], "SYS")
    assert conv == [{"role": "system", "content": "SYS"}, {"role": "user", "content": "hi"}]
    assert prompts.to_prompt([{"role": "assistant", "content": "x"}], "SYS") is None
    kept = prompts.to_prompt([{"role": "system", "content": "mine"}, {"role": "user", "content": "q"}], "SYS")
    assert kept[0]["content"] == "mine"


def test_sampler_is_deterministic_dedups_and_grows_as_superset(tmp_path):
    source = NemotronShards(make_shards(tmp_path))
    cfg = SamplerConfig(quotas={"chat": 10, "math": 5, "code": 0}, seed=3)
    first, stats = prompts.sample_prompts(source, cfg)
    again, _ = prompts.sample_prompts(source, cfg)
    assert first == again
    assert stats["chat"]["kept"] == 10 and stats["math"]["kept"] == 5 and "code" not in stats
    users = [prompts.user_text_hash(r["conversations"]) for r in first]
    assert len(users) == len(set(users))
    # chosen ids are the lowest md5(uuid) among unique user texts
    chat_ids = sorted((r["id"] for r in first if r["category"] == "chat"), key=prompts.md5_hex)
    bigger, _ = prompts.sample_prompts(source, SamplerConfig(quotas={"chat": 20, "math": 5}, seed=3))
    assert set(chat_ids) <= {r["id"] for r in bigger}
    assert all(r["conversations"][0]["role"] == "system" and r["conversations"][-1]["role"] == "user" for r in first)
    other_seed, _ = prompts.sample_prompts(source, SamplerConfig(quotas={"chat": 10, "math": 5, "code": 0}, seed=4))
    assert {r["id"] for r in other_seed} == {r["id"] for r in first} and other_seed != first


def test_sampler_excludes_and_caps_prompt_length(tmp_path):
    source = NemotronShards(make_shards(tmp_path))
    base, _ = prompts.sample_prompts(source, SamplerConfig(quotas={"chat": 5}, shuffle=False))
    excluded = {base[0]["id"]}
    rest, _ = prompts.sample_prompts(source, SamplerConfig(quotas={"chat": 5}, shuffle=False), exclude=excluded)
    assert not excluded & {r["id"] for r in rest}
    # "chat question 1" has 15 characters, "chat question 12" 16: a cap of 16 keeps only one-digit ones
    capped, stats = prompts.sample_prompts(source, SamplerConfig(quotas={"chat": 3}, max_prompt_tokens=16),
                                           count_tokens=lambda conv: len(conv[-1]["content"]))
    assert all(len(r["conversations"][-1]["content"]) < 16 for r in capped)
    assert stats["chat"]["dropped_too_long"] > 0


def test_manifest_rebuild_warns_about_missing_uuids(tmp_path, caplog):
    source = NemotronShards(make_shards(tmp_path))
    manifest = tmp_path / "manifest.txt"
    manifest.write_text("chat-0001\n\nmath-0003\nnot-there-1\nnot-there-2\n")
    with caplog.at_level(logging.WARNING):
        rows, missing = prompts.rebuild_from_manifest(source, prompts.read_manifest(manifest), "SYS")
    assert missing == 2 and {r["id"] for r in rows} == {"chat-0001", "math-0003"}
    assert "2 of 4 uuids not found" in caplog.text


def test_empty_or_malformed_sources_fail_clearly(tmp_path):
    (tmp_path / "empty" / "data").mkdir(parents=True)
    with pytest.raises(PromptSourceError, match="no \\*.parquet shards"):
        NemotronShards(tmp_path / "empty")
    bad = tmp_path / "bad" / "data"
    bad.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([{"id": 1, "text": "x"}]), bad / "chat-00000-of-00001.parquet")
    with pytest.raises(PromptSourceError, match="chat-00000-of-00001.parquet: cannot read columns"):
        prompts.sample_prompts(NemotronShards(tmp_path / "bad"), SamplerConfig(quotas={"chat": 1}))
    with pytest.raises(PromptSourceError, match="split 'stem'"):
        prompts.sample_prompts(NemotronShards(make_shards(tmp_path / "ok")), SamplerConfig(quotas={"stem": 1}))
    with pytest.raises(PromptSourceError, match="hub_allowed is false"):
        NemotronShards("nvidia/Nemotron-Post-Training-Dataset-v2")
    with pytest.raises(PromptSourceError, match="does not exist"):
        prompts.read_manifest(tmp_path / "nope.txt")


def test_local_sources_give_disjoint_stage_sets(tmp_path):
    from eqc_utils.params import load_params
    params = load_params("tiny", {"prompts.max_prompt_tokens": None})
    stats = prompts.build_prompt_sets(params, tmp_path)
    from eqc_utils.io import read_jsonl
    s1, s2 = read_jsonl(tmp_path / "prompts_stage1.jsonl"), read_jsonl(tmp_path / "prompts_stage2.jsonl")
    assert len(s1) == sum(params["prompts"]["stage1_quotas"].values())
    assert not {r["id"] for r in s1} & {r["id"] for r in s2}
    assert stats["stage2"]["math"]["kept"] == params["prompts"]["stage2_quotas"]["math"]
