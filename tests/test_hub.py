"""Hub data and tokenizers offline: one probe, then the libraries' offline mode (a cached copy still
loads, anything else fails at once instead of after ~30-50 s of retries)."""

from __future__ import annotations

import pytest

datasets = pytest.importorskip("datasets")

from huggingface_hub import constants  # noqa: E402

from fedbasin.data import hub, load_task  # noqa: E402


@pytest.mark.parametrize("reachable, env, proxy, offline", [
    (False, "", "", True), (True, "", "", False),
    (False, "0", "", False),  # the network asked for: no probe
    (False, "", "http://proxy.invalid:3128", False),  # a proxy carries the traffic: a direct probe says nothing
])
def test_hub_calls_run_offline_when_the_hub_cannot_be_reached(monkeypatch, reachable, env, proxy, offline):
    monkeypatch.setattr(hub, "hub_reachable", lambda: reachable)
    monkeypatch.setenv("HF_HUB_OFFLINE", env)
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    if proxy:
        monkeypatch.setenv("HTTPS_PROXY", proxy)
    before = (constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE)
    seen = []

    def load_dataset(*args, **kwargs):
        seen.append((constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE))
        raise ConnectionError("Couldn't reach 'uoft-cs/cifar10' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    with pytest.raises(RuntimeError, match="offline, use 'cifar10:PATH'"):
        load_task("cifar10")
    assert seen == [(True, True)] if offline else seen == [before]
    assert (constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE) == before  # restored


def test_nested_offline_blocks_restore_the_flags_once_the_last_ends(monkeypatch):
    monkeypatch.setattr(hub, "hub_reachable", lambda: False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    before = constants.HF_HUB_OFFLINE
    with hub.hub_access():
        with hub.hub_access():
            assert constants.HF_HUB_OFFLINE is True
        assert constants.HF_HUB_OFFLINE is True  # the outer block still runs offline
    assert constants.HF_HUB_OFFLINE == before
