import json

import torch
from transformers import AutoModelForCausalLM

from conftest import reference_greedy
from helpers import cli

STATS_KEYS = {"rounds", "drafted_tokens", "accepted_tokens", "mean_accepted_length", "target_forward_passes",
              "drafter_forward_passes", "wall_time_s", "tokens_per_s"}


def test_json_output_is_one_object_with_stable_keys(tiny_model_dir):
    proc = cli("generate", "w5 w6 w7 w5 w6", "--model", str(tiny_model_dir), "--json", "--max-new-tokens", "20",
               "--drafter", "prompt-lookup", "--policy", "failfast")
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(proc.stdout)
    assert {"text", "token_ids", "prompt_token_ids", "stats"} <= set(obj)
    assert STATS_KEYS <= set(obj["stats"])
    # the CLI loads the folder in float32: compare with that model's own greedy decoding
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert obj["token_ids"] == reference_greedy(model, obj["prompt_token_ids"], 20)


def test_drafter_none_and_raw_and_chat_template(tiny_model_dir):
    chat = json.loads(cli("generate", "w5 w6", "--model", str(tiny_model_dir), "--json", "--drafter", "none",
                          "--max-new-tokens", "5").stdout)
    raw = json.loads(cli("generate", "w5 w6", "--model", str(tiny_model_dir), "--json", "--raw",
                         "--max-new-tokens", "5").stdout)
    assert len(raw["prompt_token_ids"]) == 2 < len(chat["prompt_token_ids"])
    assert chat["stats"]["drafted_tokens"] == 0 and chat["stats"]["mean_accepted_length"] == 1.0


def test_streaming_text_then_one_stats_line(tiny_model_dir):
    proc = cli("generate", "w5 w6 w7 w5 w6", "--model", str(tiny_model_dir), "--max-new-tokens", "12", "--policy",
               "fixed", "--gamma", "3", "--temperature", "0.8", "--seed", "3", "--top-k", "5", "--top-p", "0.9")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    stats = [l for l in proc.stderr.splitlines() if l.startswith("[") and "tok/s" in l]
    assert len(stats) == 1 and "mean accepted length" in stats[0]


def test_list_drafters():
    proc = cli("generate", "--list-drafters")
    assert proc.returncode == 0 and "prompt-lookup" in proc.stdout and "none" in proc.stdout
