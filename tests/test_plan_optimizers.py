"""The planner's optimizers (trainer/plan/optimizer_memory.py): each one's state per rank as
its code keeps it, Adafactor's replicated column statistics, Muon's step buffers and owner
workspace by the trainer's owner packing, the step's communication, and `plan --optimizer X`."""

import json
from dataclasses import replace

import pytest
from plan_helpers import SETUP, SHAPE

import cli
from trainer.plan import optimizer_memory
from trainer.plan.ledger import comm_bytes, simulate
from trainer.plan.search import choose

P = SHAPE.params
# SHAPE's 2-D weights: per layer qkv (768 × 256), out (256 × 256), fc1 (1024 × 256),
# fc2 (256 × 1024); the root's tied embedding (5000 × 256) and learned positions (128 × 256).
LAYER_ROWS = 768 + 256 + 1024 + 256
# Adafactor's columns per logical matrix: qkv_proj is q, k and v (256 × 256 each)
LAYER_COLS = 3 * 256 + 256 + 256 + 1024
WEIGHTS = 4 * (768 * 256 + 256 * 256 + 1024 * 256 + 256 * 1024) + (5000 + 128) * 256


def setup(optimizer, **kw):
    states = optimizer_memory.ELEMENTWISE_STATES.get(optimizer, 0)
    return replace(SETUP, optimizer=optimizer, optimizer_states=states, **kw)


def most(s, component):
    """The largest number of bytes `component` holds during the update."""
    return simulate(SHAPE, s)[0].most.get(component, 0)


@pytest.mark.parametrize("optimizer, per_element", [("lamb", 8), ("adamax", 8), ("adadelta", 8), ("adagrad", 4)])
def test_elementwise_state_is_sharded_with_the_parameters(optimizer, per_element):
    assert most(setup(optimizer), "optimizer_state") == pytest.approx(per_element * P / 4)
    assert most(setup(optimizer), "optimizer_state_replicated") == 0


def test_adafactor_keeps_rows_sharded_and_columns_whole():
    rows = 4 * LAYER_ROWS + 5000 + 128
    columns = 4 * LAYER_COLS + 2 * 256
    vectors = P - WEIGHTS
    for shard in (2, 4):
        s = setup("adafactor", world=shard, ranks_per_host=shard, shard=shard)
        assert most(s, "optimizer_state") == pytest.approx(4 * (rows + vectors) / shard)
        # every rank keeps every matrix's column statistics: not divided by the ranks
        assert most(s, "optimizer_state_replicated") == pytest.approx(4 * columns)
    with_beta1 = most(setup("adafactor", first_moment=True), "optimizer_state")
    assert with_beta1 - most(setup("adafactor"), "optimizer_state") == pytest.approx(4 * P / 4)


def test_adafactor_and_lamb_hold_every_update_at_the_step():
    for optimizer in ("adafactor", "lamb"):
        assert most(setup(optimizer), "optimizer_step") >= 4 * P / 4
    assert most(setup("adam"), "optimizer_step") == 0  # fused, in place


def test_muon_state_momentum_for_layer_matrices_adamw_for_the_rest():
    matrices = 4 * (768 * 256 + 256 * 256 + 1024 * 256 + 256 * 1024)
    assert most(setup("muon"), "optimizer_state") == pytest.approx((4 * matrices + 8 * (P - matrices)) / 4)


def test_muon_owner_workspace_follows_the_owner_packing(monkeypatch):
    packed = most(setup("muon"), "muon_owner_workspace")
    assert packed > 0
    # every matrix on rank 0: that rank holds all of them whole
    monkeypatch.setattr(optimizer_memory, "owners_by_work", lambda works, ranks: [0] * len(works))
    everything = most(setup("muon"), "muon_owner_workspace")
    assert everything > 3 * packed
    matrices = 4 * (768 * 256 + 256 * 256 + 1024 * 256 + 256 * 1024)
    assert everything >= 3 * 2 * matrices  # received, whole, results and the flat send, bf16


def test_owner_packing_is_the_trainers():
    from trainer.parallel import matrix_owners

    assert matrix_owners.owners_by_work is optimizer_memory.owners_by_work


def test_step_communication():
    two = dict(world=2, ranks_per_host=2, shard=2)
    muon = comm_bytes(SHAPE, setup("muon", **two))
    matrices = 4 * (768 * 256 + 256 * 256 + 1024 * 256 + 256 * 1024)
    assert muon["all_to_all"] == pytest.approx(2 * 2 * matrices / 2 / 2)  # bf16, both ways, half from the peer
    adam = comm_bytes(SHAPE, setup("adam", **two))
    assert adam["all_to_all"] == 0
    assert comm_bytes(SHAPE, setup("adafactor", **two))["all_reduce"] > adam["all_reduce"]
    alone = comm_bytes(SHAPE, setup("muon", world=1, ranks_per_host=1, shard=1, backend="pytorch_ddp"))
    assert set(alone.values()) == {0}


def test_the_flag_search_keeps_the_optimizer():
    given = setup("muon", sequences=8)
    tried, _ = choose(SHAPE, given, device_gb=0.05, host_gb=None)
    assert tried and all(s.optimizer == "muon" for _, s, _, _ in tried)


def test_plan_command(capsys):
    """`plan --optimizer X` for each: the state it reports is X's (a model of 14.7 M
    parameters on 2 ranks, whose peak is in backward: the state is there whatever the peak)."""
    argv = ["--cpu", "--task", "dummy_lm", "--dict-size", "8192", "--decoder-layers", "2", "--batch-size", "2"]
    argv += ["--ddp-backend", "fully_sharded", "--distributed-world-size", "2", "--host-memory-gb", "16"]
    state = {}
    for optimizer in ("adam", "adafactor", "lamb", "adagrad", "adamax", "adadelta", "muon"):
        assert cli.plan_main(argv + ["--optimizer", optimizer, "--format", "json"]) == 0
        components = json.loads(capsys.readouterr().out)["components"]
        assert {"optimizer_state_replicated", "optimizer_step", "muon_owner_workspace"} <= set(components)
        state[optimizer] = components["optimizer_state"]
    assert state["adam"] == state["lamb"] == state["adamax"] == state["adadelta"] > 0
    assert state["adagrad"] == pytest.approx(state["adam"] / 2, abs=0.001)
    assert state["adafactor"] < state["muon"] < state["adam"]
    assert cli.plan_main(argv + ["--optimizer", "muon"]) == 0
    assert "--optimizer muon" in capsys.readouterr().out
