"""`diffspec bench`: measure methods (ours and transformers') on prompt sets, check losslessness.

    from diffspec.bench import BenchConfig, run_bench
    result = run_bench(BenchConfig(dataset="humaneval", num_prompts=5, methods=("plain", "failfast")),
                       target, out="bench-out")
    result.exit_code  # 1 when any method's greedy output differed from plain's

Modules: `methods` (the registry of stable method names and their parameters), `runners` (how each
method generates and what it counts), `specs` (what the user asks for: method specs and sweeps), `prompts`
(packaged sets and the user's JSONL), `run` (the interleaved measurement loop), `report`
(summary statistics, results.jsonl / summary.md / summary.json), `plots` (PNG plots).
"""

from .methods import METHODS, MethodDef, Param, list_methods
from .prompts import BenchPrompt, load_bench_prompts, load_jsonl_prompts
from .report import best_per_dataset, summarize, write_outputs
from .run import DEFAULT_METHODS, BenchConfig, BenchResult, machine_info, prepare, run_bench
from .runners import Outcome, Runner
from .specs import MethodSpec, expand_methods, parse_method

__all__ = ["METHODS", "MethodDef", "MethodSpec", "Outcome", "Param", "Runner", "expand_methods", "list_methods",
           "parse_method", "BenchPrompt", "load_bench_prompts", "load_jsonl_prompts", "best_per_dataset", "summarize",
           "write_outputs", "DEFAULT_METHODS", "BenchConfig", "BenchResult", "machine_info", "prepare", "run_bench"]
