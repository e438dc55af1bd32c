"""The backend registry: every backend answers supports(spec); "auto" takes the first that says
yes for the inputs' device, warns about the ones it skipped, and explain_backend says why."""

from __future__ import annotations

import warnings

import pytest
import torch

import flexfa
from flexfa.api import build_spec
from flexfa.backends import base
from flexfa.backends.base import Backend, Support


def qkv(dtype=torch.float32):
    return tuple(torch.randn(1, 2, 16, 16, dtype=dtype) for _ in range(3))


def test_auto_runs_the_tiled_backend_on_cpu():
    q, k, v = qkv()
    spec = flexfa.build_spec(q, k, v)
    assert flexfa.backends.select("auto", spec).name == "tiled"
    assert flexfa.backends.select("tiled", spec).name == "tiled"
    torch.testing.assert_close(
        flexfa.attention(q, k, v), flexfa.attention(q, k, v, backend="tiled")
    )


def test_explain_backend_lists_every_backend_with_a_reason():
    *lines, auto = flexfa.explain_backend(*qkv(), block_mask=flexfa.masks.causal).splitlines()
    names = [line.split(":")[0] for line in lines]
    assert names == flexfa.backends.names() and "tiled" in names
    assert "tiled: yes" in lines
    for line in lines:
        assert line.endswith(": yes") or (": no (" in line and line.endswith(")"))
    assert auto == f"auto: {flexfa.backends.select('auto', build_spec(*qkv())).name}"


class _Stub(Backend):
    def __init__(self, name: str, answer: Support) -> None:
        self.name = name
        self.answer = answer
        self.auto_device_types = frozenset({"cpu"})
        self.calls = 0

    def supports(self, spec):
        return self.answer

    def run(self, spec, q, k, v):
        self.calls += 1
        out = torch.zeros(spec.batch, spec.heads_q, spec.len_q, spec.head_dim_v, dtype=q.dtype)
        return out, torch.zeros(spec.batch, spec.heads_q, spec.len_q)


@pytest.fixture
def stubs(monkeypatch):
    """A registry holding only: refuses (first), accepts (second), tiled (last)."""
    refuses = _Stub("refuses", Support.no("needs a GPU with 1 TB of memory"))
    accepts = _Stub("accepts", Support.yes())
    tiled = base._load("tiled")
    monkeypatch.setattr(base, "_LAZY", {})
    monkeypatch.setattr(base, "_REGISTRY", {"refuses": refuses, "accepts": accepts, "tiled": tiled})
    monkeypatch.setattr(base, "_warned", set())
    return refuses, accepts


def test_auto_takes_the_first_backend_that_says_yes(stubs):
    refuses, accepts = stubs
    with pytest.warns(
        UserWarning, match="the 'refuses' backend cannot run this call \\(needs a GPU"
    ):
        out = flexfa.attention(*qkv())
    assert accepts.calls == 1 and refuses.calls == 0
    assert torch.equal(out, torch.zeros_like(out))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning is given once per (backend, reason)
        flexfa.attention(*qkv())
    explained = flexfa.explain_backend(*qkv()).splitlines()
    assert explained == [
        "refuses: no (needs a GPU with 1 TB of memory)",
        "accepts: yes",
        "tiled: yes",
        "auto: accepts",
    ]


def test_explain_backend_names_autos_choice_without_warning(stubs, monkeypatch):
    """A backend that can run a call is not always auto's choice (Note [Which backend auto
    picks]); explain_backend says which one auto takes, and asking warns about nothing (nor
    uses up the warning a later call gives)."""
    _, accepts = stubs
    monkeypatch.setattr(accepts, "auto_prefers", lambda spec: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert flexfa.explain_backend(*qkv()).splitlines()[-2:] == ["tiled: yes", "auto: tiled"]
    with pytest.warns(UserWarning, match="the 'refuses' backend cannot run this call"):
        flexfa.attention(*qkv())


def test_a_named_backend_that_refuses_says_why(stubs):
    with pytest.raises(ValueError, match="backend 'refuses' cannot run this call: needs a GPU"):
        flexfa.attention(*qkv(), backend="refuses")


def test_auto_skips_backends_for_other_devices(stubs, monkeypatch):
    _, accepts = stubs
    monkeypatch.setattr(accepts, "auto_device_types", frozenset({"cuda"}))
    with pytest.warns(UserWarning):
        flexfa.attention(*qkv())
    assert accepts.calls == 0  # the tiled backend ran instead
