"""Which kernel family the dispatcher chose, for GPU tests that must know what really ran."""


def backward_sources(monkeypatch) -> list:
    """Wrap ``cuflash._families.choose`` (for this test) so that the source of every backward
    family it picks is appended to the returned list. Plans are built once and cached: clear
    them (``cuflash._api.clear_plans``) so that the test's calls build theirs."""
    from cuflash import _families
    seen, choose = [], _families.choose

    def spy(kind, *args, **kwargs):
        choice = choose(kind, *args, **kwargs)
        if kind == "bwd":
            seen.append(choice.family.source)
        return choice

    monkeypatch.setattr(_families, "choose", spy)
    return seen


def forward_sources(monkeypatch) -> list:
    """:func:`backward_sources` for the forward families."""
    from cuflash import _families
    seen, choose = [], _families.choose

    def spy(kind, *args, **kwargs):
        choice = choose(kind, *args, **kwargs)
        if kind == "fwd":
            seen.append(choice.family.source)
        return choice

    monkeypatch.setattr(_families, "choose", spy)
    return seen
