"""Which kernel family the dispatcher chose, for GPU tests that must know what really ran."""


def sources(monkeypatch, kind: str) -> list:
    """Wrap ``cuflash._families.choose`` (for this test) so that the source of every ``kind``
    ("fwd" or "bwd") family it picks is appended to the returned list. Plans are built once and
    cached: clear them (``cuflash._api.clear_plans``) so that the test's calls build theirs."""
    from cuflash import _families
    seen, choose = [], _families.choose

    def spy(k, *args, **kwargs):
        choice = choose(k, *args, **kwargs)
        if k == kind:
            seen.append(choice.family.source)
        return choice

    monkeypatch.setattr(_families, "choose", spy)
    return seen


def backward_sources(monkeypatch) -> list:
    """:func:`sources` of the backward families."""
    return sources(monkeypatch, "bwd")


def forward_sources(monkeypatch) -> list:
    """:func:`sources` of the forward families."""
    return sources(monkeypatch, "fwd")
