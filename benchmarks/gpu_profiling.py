"""What the GPU profiling scripts share (benchmarks/gpu_pass_overhead.py, benchmarks/gpu_make_data_profile.py):
a random model of SmolLM2-135M's shape (no weights to carry to a lent machine), and a torch profiler table
written whole to a file and printed cut to fit a log."""
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def smollm2_shaped(device, layers: int = 30, dtype=torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)
    return LlamaForCausalLM(cfg).to(dtype).to(device).eval()


def write_profile_table(prof, sort_by: str, path: Path, name: str, lines: int = 22) -> None:
    table = prof.key_averages().table(sort_by=sort_by, row_limit=30, max_name_column_width=70)
    Path(path).write_text(table)
    print(name, "\n", "\n".join(line[:70] + line[-60:] for line in table.splitlines()[:lines]), flush=True)
