"""The one-call API: engines are built once per configuration and reused."""

import diffspec
from diffspec import api


def test_engines_are_built_once_per_configuration_and_reused(tiny_model_dir, monkeypatch):
    built = []
    real = api.make_drafter
    monkeypatch.setattr(api, "make_drafter", lambda *a, **k: built.append(a[0]) or real(*a, **k))
    model = str(tiny_model_dir)
    first = diffspec.generate([5, 6, 7, 5, 6], model=model, drafter="prompt-lookup", max_new_tokens=8)
    again = diffspec.generate([5, 6, 7, 5, 6], model=model, drafter="prompt-lookup", max_new_tokens=8)
    assert built == ["prompt-lookup"]  # the second call reused the engine (and any drafter timing)
    assert again.token_ids == first.token_ids
    a = api.load_engine(model, "prompt-lookup", "fixed", gamma=3)
    assert api.load_engine(model, "prompt-lookup", "fixed", gamma=3) is a
    assert api.load_engine(model, "prompt-lookup", "fixed", gamma=4) is not a
    assert api.load_engine(model, "none") is not a
    assert built == ["prompt-lookup", "prompt-lookup", "prompt-lookup", "none"]
    assert a.target is api.load_engine(model, "none").target  # one target per (model, dtype, device)
