"""Deployment security on localhost: certificates from scripts/make_certs.sh, a TLS SuperLink with
SuperNode authentication, two registered SuperNodes completing a round via ``flwr run``, and an
unregistered SuperNode refused."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from fedbasin.deployment import LocalFederation, wait_for, write_node_keys

ROOT = Path(__file__).resolve().parents[1]


def make_certs(out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / "make_certs.sh"), str(out)], capture_output=True,
                          text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tls") / "certificates"
    made = make_certs(out)
    assert made.returncode == 0, made.stderr
    return out


def test_make_certs_refuses_to_overwrite_a_ca(certificates):
    before = {p.name: p.read_bytes() for p in certificates.iterdir()}
    assert sorted(before) == ["ca.crt", "ca.key", "server.key", "server.pem"]
    again = make_certs(certificates)
    assert again.returncode == 1
    assert "refusing to overwrite an existing CA" in again.stderr
    assert {p.name: p.read_bytes() for p in certificates.iterdir()} == before  # nothing touched, no temp dir
    verified = subprocess.run(["openssl", "verify", "-CAfile", str(certificates / "ca.crt"),
                               str(certificates / "server.pem")], capture_output=True, text=True, check=False)
    assert verified.returncode == 0, verified.stderr


@pytest.mark.slow
def test_tls_round_with_registered_supernodes_and_unregistered_refused(certificates, tmp_path):
    out = tmp_path / "run"
    federation = LocalFederation(tmp_path / "deployment", certificates=certificates, node_auth=True)
    try:
        federation.start_superlink()
        keys = [tmp_path / f"supernode-{i}" for i in range(3)]
        public = [write_node_keys(k) for k in keys]
        registered = {federation.register(public[i]) for i in range(2)}  # supernode-2 stays unregistered
        for i in range(2):
            federation.start_supernode(f"supernode-{i}", f"partition-id={i} num-partitions=2", keys[i])

        def online() -> bool:
            nodes = federation.flwr("supernode", "list", "local-deployment")["nodes"]
            return {int(n["node-id"]) for n in nodes if n["status"] == "online"} == registered

        wait_for(online, 90, "both registered SuperNodes online", interval=1.0)

        # an unregistered key is refused at activation; a node without a key would register
        # itself, which --enable-supernode-auth forbids
        intruders = {"unregistered-key": federation.start_supernode("unregistered-key", "partition-id=0 "
                                                                    "num-partitions=2", keys[2]),
                     "no-key": federation.start_supernode("no-key", "partition-id=1 num-partitions=2")}
        wait_for(lambda: all(p.poll() is not None for p in intruders.values()), 90, "the intruders to be refused")
        for name, intruder in intruders.items():
            assert intruder.returncode != 0, federation.tail(name)
        assert "Failed to activate SuperNode" in federation.tail("unregistered-key"), federation.tail("unregistered-key")
        assert "All SuperNodes must be registered via the CLI" in federation.tail("no-key"), federation.tail("no-key")

        run_config = f"num-server-rounds=1 local-epochs=1 fraction-evaluate=0.0 out-dir='{out}'"
        run_id = federation.submit(ROOT, run_config)
        status = federation.wait_finished(run_id, 240)
        assert status == "finished:completed", federation.tails()
        rounds = json.loads((out / "results.json").read_text())["rounds"]
        assert [r["round"] for r in rounds] == [0, 1]
        assert rounds[1]["num_excluded"] == 0 and "train_loss" in rounds[1]
        nodes = federation.flwr("supernode", "list", "local-deployment")["nodes"]
        assert {int(n["node-id"]) for n in nodes} == registered  # no intruder ever joined
    finally:
        federation.close()
    assert federation.left_running() == []  # SuperExec and app processes included
