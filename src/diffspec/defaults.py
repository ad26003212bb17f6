"""The names and defaults the command line shows, in a module that imports nothing heavy: `diffspec --help` and
a bad argument are answered without loading torch or transformers (2.7-4.5 s of imports on a 2-core CPU). The
modules that act on these values (api, models, drafter_names, backends, kernels, compiled, evaluation, policies,
bench.run, training.conditioned) import them from here, under the names they had."""

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_DRAFTER = "auto"  # prompt-lookup (+ the shipped trained drafter for the target, with the auto policy)
DEFAULT_POLICY = "auto"   # measured costs: draft length per round, speculation off where it loses
FC_INITS = ("random", "lowest-layer")  # train-drafter --fc-init
#: the settings each --policy reads (policies/__init__.py)
FAILFAST_DEFAULTS = {"tau": 0.45, "n": 10, "n_max": 60}  # the paper's (policies/failfast.py)
POLICY_SETTINGS = {"fixed": ("gamma",), "failfast": ("tau", "n", "n_max"), "auto": ("recalibrate",)}
BACKENDS = ("auto", "transformers", "llama.cpp")  # --backend (backends/__init__.py)
KERNELS = ("auto", "multi-row", "stock", "q8")  # --kernels (kernels.py)
COMPILE_MODES = ("off", "on", "auto")  # --compile (compiled.py)
EVALUATION_DOMAINS = {"humaneval": "code", "mtbench": "chat", "champ": "math"}  # eval-drafter sets -> domain
DEFAULT_BENCH_METHODS = ("hf-generate", "plain", "hf-prompt-lookup", "prompt-lookup")  # bench --methods (bench/run.py)

PRESET_NAMES = ("fast-dllm-v2", "dream")  # published layouts checkpoint.PRESETS reads (names here: no torch)

DRAFTER_NAMES = {
    "auto": "the default: with the auto policy, prompt-lookup+KIND when a trained drafter ships for this target; "
            "else the shipped drafter if measurement made it the default, else prompt-lookup",
    "none": "no drafter: plain autoregressive decoding through the same engine (the fair baseline)",
    "prompt-lookup": "n-gram copy from the prompt and the text so far (training-free)",
    "block-diffusion": "block-diffusion dLLM (Fast-dLLM v2 semantics), FailFast's drafter",
    "masked-diffusion": "masked-diffusion dLLM with T denoising steps (SpecDiff)",
    "conditioned": "target-conditioned block drafter reading the target's hidden states (DFlash-style)",
    "ar:PATH": "an autoregressive draft model (folder, .gguf or hub id) sharing the target's tokenizer",
    "PATH": "a drafter folder (config.json + model.safetensors) written by diffspec, or a DFlash checkpoint "
            "(folder or hub id owner/name)",
    "A+B": "two drafters combined, e.g. prompt-lookup+conditioned: each round the proposal worth more is verified "
           "(put the cheap one first)",
    "fast-dllm-v2:PATH": "a Fast-dLLM v2 checkpoint (Qwen2 body, block 32, sub-block 8, shifted, mask 151665)",
    "dream:PATH": "a Dream checkpoint (Qwen2 body, bidirectional, shifted, mask 151666)",
}
