"""Errors a user can cause and fix. The CLI prints them as one line and exits with code 2."""


class DiffspecError(ValueError):
    """Bad input or configuration: the message names the problem and, where possible, the fix."""


def positive_int(text: str, message: str) -> int:
    """The integer >= 1 that `text` spells; anything else raises DiffspecError(message)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise DiffspecError(message)
    return value


def refuse_misplaced_system_message(tokenizer, chat: bool, model_name: str, raw_flag: str = "") -> None:
    """A system message needs the chat template: refused (never dropped) where the prompt goes in raw or the
    tokenizer has none. One wording for Target.encode_prompt and the CLI's check before loading."""
    if chat and getattr(tokenizer, "chat_template", None):
        return
    why = f"the prompt goes in raw{raw_flag}" if not chat else f"model '{model_name}' has no chat template"
    raise DiffspecError(f"a system message needs the chat template, but {why}")
