"""Stop tokens: generation_config's EOS, the tokenizer's EOS and the chat template's end-of-turn token
(the one written after an assistant message), and no other special token of the template."""

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from conftest import make_model, make_tokenizer, reference_greedy
from diffspec import SpeculativeEngine, Target
from diffspec.target import chat_stop_token_ids, template_end_of_turn_id

# Meta-Llama-3-8B-Instruct's chat template, verbatim
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}"
          "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
          "+ message['content'] | trim + '<|eot_id|>' %}"
          "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# <|end_of_text|> gets id 2, the EOS that conftest's make_model puts in generation_config
LLAMA3_SPECIALS = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>"]


def make_llama3_tokenizer(template=LLAMA3) -> PreTrainedTokenizerFast:
    """A word-level tokenizer with Llama-3's special tokens (added tokens: they split without spaces)."""
    vocab = {tok: i for i, tok in enumerate(LLAMA3_SPECIALS)}
    for word in ["system", "user", "assistant"] + [f"w{i}" for i in range(40)]:
        vocab[word] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<|begin_of_text|>",
                                  eos_token="<|end_of_text|>",
                                  additional_special_tokens=["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    tok.chat_template = template
    return tok


def ids_of(tok, *tokens):
    return [tok.convert_tokens_to_ids(t) for t in tokens]


def test_llama3_stops_on_eot_and_eos_but_not_on_header_tokens():
    tok = make_llama3_tokenizer()
    eos, eot, start_header, end_header = ids_of(tok, "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>",
                                                "<|end_header_id|>")
    target = Target(make_model(len(tok)), tok)
    assert eot in target.stop_token_ids and eos in target.stop_token_ids
    assert end_header not in target.stop_token_ids and start_header not in target.stop_token_ids
    assert target.stop_token_ids == {eos, eot}


def test_chatml_end_of_turn_is_a_stop_token():
    tok = make_tokenizer()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert template_end_of_turn_id(tok) == im_end
    assert im_end in Target(make_model(len(tok)), tok).stop_token_ids


def test_end_of_turn_that_is_not_eos_is_found():
    """ChatML with a different EOS: <|im_end|> comes from the template, not from eos_token."""
    tok = make_tokenizer()
    tok.eos_token = "<pad>"
    im_start, im_end, pad = ids_of(tok, "<|im_start|>", "<|im_end|>", "<pad>")
    assert chat_stop_token_ids(tok) == {pad, im_end}
    assert im_start not in chat_stop_token_ids(tok)


def test_no_chat_template_means_eos_only():
    tok = make_llama3_tokenizer(template=None)
    eos, eot = ids_of(tok, "<|end_of_text|>", "<|eot_id|>")
    assert template_end_of_turn_id(tok) is None
    assert chat_stop_token_ids(tok) == {eos}
    model = make_model(len(tok))
    assert Target(model, tok).stop_token_ids == {eos}
    model.generation_config.eos_token_id = [eos, eot]  # Llama-3-Instruct's generation_config lists both
    assert Target(model, tok).stop_token_ids == {eos, eot}
    assert Target(model, None).stop_token_ids == {eos, eot}


def test_named_templates_use_the_default_one():
    tok = make_llama3_tokenizer(template=None)
    tool_use = "{% for m in messages %}{{ m['content'] }}<|end_header_id|>{% endfor %}"
    tok.chat_template = {"default": LLAMA3, "tool_use": tool_use}
    assert template_end_of_turn_id(tok) == tok.convert_tokens_to_ids("<|eot_id|>")


def test_templates_that_raise_or_end_in_plain_text_fall_back_to_eos():
    eos = make_llama3_tokenizer().eos_token_id
    raising = "{{ raise_exception('no assistant messages here') }}"
    plain_text = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} w3 {% endfor %}"
    no_default = {"tool_use": LLAMA3}
    for template in (raising, plain_text, no_default):
        tok = make_llama3_tokenizer(template=template)
        assert template_end_of_turn_id(tok) is None, template
        assert chat_stop_token_ids(tok) == {eos}


def test_template_that_needs_a_system_message():
    needs_system = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}"
                    + LLAMA3)
    tok = make_llama3_tokenizer(template=needs_system)
    assert template_end_of_turn_id(tok) == tok.convert_tokens_to_ids("<|eot_id|>")


def test_template_that_closes_only_earlier_turns():
    """A template that leaves the last message open: the end-of-turn token shows after a reply followed by
    another turn."""
    open_last = LLAMA3.replace("+ '<|eot_id|>' %}", "+ ('' if loop.last else '<|eot_id|>') %}")
    assert open_last != LLAMA3
    tok = make_llama3_tokenizer(template=open_last)
    assert template_end_of_turn_id(tok) == tok.convert_tokens_to_ids("<|eot_id|>")


def test_greedy_does_not_stop_on_end_header_and_matches_the_reference():
    """A model pushed to emit <|end_header_id|> mid-answer: the engine runs on past it and stops where
    greedy decoding with generate's stop ids (EOS + <|eot_id|>) stops."""
    tok = make_llama3_tokenizer()
    eos, eot, end_header = ids_of(tok, "<|end_of_text|>", "<|eot_id|>", "<|end_header_id|>")
    model = make_model(len(tok), seed=0)
    prompt = Target(model, tok).encode_prompt("w1 w2 w3")
    free = reference_greedy(model, prompt, 20, stop_ids=())
    with torch.no_grad():  # <|end_header_id|> now outscores the 3rd token wherever that one leads
        model.lm_head.weight[end_header] = 1.5 * model.lm_head.weight[free[2]]
    target = Target(model, tok)
    expected = reference_greedy(model, prompt, 20, stop_ids=(eos, eot))
    assert end_header in expected[:-1]  # the case is not vacuous: the header token is emitted mid-answer
    r = SpeculativeEngine(target, None).generate(prompt, max_new_tokens=20)
    assert r.token_ids == expected
    assert r.finish_reason == ("stop" if expected[-1] in (eos, eot) else "length")
