"""The CLI as a user meets it: --help with examples, JSON keys of the contract, one-line errors with exit 2."""

import json

import pytest

from tests.conftest import ROOT


def test_help_has_examples(cli):
    p = cli("plan", "--help")
    assert p.returncode == 0 and "examples:" in p.stdout and "kvcap plan --model" in p.stdout


def test_plan_json_contract_keys(cli_json):
    d = cli_json("plan", "--model", "llama-3.1-8b", "--gpu", "rtx4090", "--nodes", "4", "--input-tokens", "1024",
                 "--output-tokens", "256", "--remote-mem", "256GiB", "--link", "100Gbps", "--rate", "3")
    for key in ("kv_bytes_per_token", "kv_tokens_per_gpu", "kv_bytes_per_request", "weights_bytes",
                "resident_requests", "input_tok_s", "output_tok_s", "link"):
        assert key in d, key
    assert set(d["resident_requests"]) >= {"hbm", "host", "remote", "total"}
    assert d["input_tok_s"] == 3 * 1024 and d["output_tok_s"] == 3 * 256
    assert d["link"]["capacity_gbps"] == pytest.approx(100.0)
    assert d["resident_requests"]["remote"] > 0 and d["resident_requests"]["host"] == 0


def test_plan_table_output(cli):
    p = cli("plan", "--scenario", str(ROOT / "scenarios" / "seed-reference.yaml"))
    assert p.returncode == 0, p.stderr
    assert "usable for KV" in p.stdout and "Resident requests" in p.stdout and "Assumptions" in p.stdout


def test_plan_scenario_with_set(cli_json):
    d = cli_json("plan", "--scenario", str(ROOT / "scenarios" / "seed-reference.yaml"),
                 "--set", "serving.kv_offload=remote", "--set", "cluster.nodes=2")
    assert d["nodes"] == 2 and d["resident_requests"]["remote"] > 0


@pytest.mark.parametrize(("args", "fragment"), [
    (["--model", "llama-3.1-9b"], "unknown model 'llama-3.1-9b': did you mean"),
    (["--model", "llama-3.1-8b", "--gpu", "h100"], "unknown GPU 'h100': did you mean h100-pcie, h100-sxm"),
    (["--model", "llama-3.1-8b", "--gpu-mem", "24Gib"], "did you mean GiB"),
    (["--model", "llama-3.1-8b", "--link", "100gbs", "--remote-mem", "1TiB"], "did you mean"),
    (["--model", "llama-3.1-8b", "--gpu-mem=-24GiB"], "size must be positive"),
    (["--model", "llama-3.1-8b", "--nodes", "0"], "positive integer"),
    (["--model", "llama-3.1-8b", "--gpu-memory-utilization", "1.5"], "between 0 and 1"),
    (["--model", "llama-3.1-8b", "--set", "cluster.nodez=3"], "cluster.nodez: unknown key"),
    (["--model", "llama-3.1-8b", "--scenario", "/nonexistent.yaml"], "not found"),
    (["--model", "/nonexistent/config.json"], "not found"),
])
def test_bad_input_one_line_exit_2(cli, args, fragment):
    p = cli("plan", *args)
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert fragment in lines[0]
    assert "Traceback" not in p.stderr


def test_malformed_and_incomplete_config(cli, tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"hidden_size": 4096, "num_attention_heads": 32}')
    p = cli("plan", "--model", str(bad))
    assert p.returncode == 2 and "lacks 'num_hidden_layers'" in p.stderr
    bad.write_text("[1, 2")
    p = cli("plan", "--model", str(bad))
    assert p.returncode == 2 and "not valid JSON" in p.stderr


def test_user_config_json(cli, tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}
    path = tmp_path / "mymodel" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    p = cli("plan", "--model", str(path), "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["model"] == "mymodel" and d["kv_bytes_per_token"] == 131_072
    assert d["parameters_source"] == "estimated"


def test_weights_that_do_not_fit_get_an_answer_exit_0(cli):
    # not fitting is a finding: KV per token and request, fits false, and the smallest TP/PP per weights dtype
    p = cli("plan", "--model", "llama-3.1-70b", "--gpu-mem", "24GiB", "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    for key in ("kv_bytes_per_token", "kv_tokens_per_gpu", "kv_bytes_per_request", "weights_bytes",
                "resident_requests"):
        assert key in d, key
    assert d["fits"] is False and "do not fit" in d["fit_problem"]
    assert d["kv_bytes_per_token"] == 327_680 and d["kv_bytes_per_request"] == 1280 * 327_680
    assert d["weights_bytes"] == 70_553_706_496 * 2 and d["resident_requests"]["total"] == 0
    smallest_tp = {o["weights_dtype"]: o["tp"] for o in d["fit_options"] if o["pp"] == 1}
    smallest_pp = {o["weights_dtype"]: o["pp"] for o in d["fit_options"] if o["tp"] == 1}
    assert smallest_tp == {"bf16": 8, "int8": 4, "int4": 2}      # hand-computed in test_plan.py
    assert smallest_pp == {"bf16": 8, "int8": 4, "int4": 2}
    tp8 = next(o for o in d["fit_options"] if o["weights_dtype"] == "bf16" and o["pp"] == 1)
    assert tp8["gpus"] == 8 and tp8["kv_tokens_per_replica"] == 108_064 and tp8["requests_per_replica"] == 84
    table = cli("plan", "--model", "llama-3.1-70b", "--gpu-mem", "24GiB")
    assert table.returncode == 0, table.stderr
    assert "Does not fit:" in table.stdout and "smallest tp and pp per weights dtype" in table.stdout
    assert "108,064" in table.stdout and "Traceback" not in table.stderr


def test_fits_true_when_it_fits(cli_json):
    d = cli_json("plan", "--model", "llama-3.1-8b", "--gpu", "rtx4090")
    assert d["fits"] is True and d["fit_problem"] is None and d["fit_options"] == []
