"""--store-ema (trainer/train/ema.py): the moving average of the weights follows fairseq's rule
(written out here, applied to the weights of every update), is the same on FSDP, DDP and one
process, continues exactly when a checkpoint resumes on another number of ranks and backend,
skips an fp16 overflow, is what --validate-with-ema validates and what the inference
commands' --ema read; a run without it ignores a saved average and one with it starts from
a checkpoint's weights when the checkpoint holds none."""

import json
import re
from pathlib import Path

import pytest
import torch

from helpers import TINY, parse_records, run_ranks

DECAY, START, FREQ = 0.8, 4, 2  # update 4 is the first decayed one: a `<=` for fairseq's `<` fails
EMA = ["--store-ema", "--ema-decay", str(DECAY), "--ema-start-update", str(START), "--ema-update-freq", str(FREQ)]
# One update of 4 sequences of the embedded corpus, dealt out alike to 1 or 2 ranks. SGD:
# Adam's first steps are about lr * sign(gradient), so a gradient near 0 summed in another
# order moves its weight by 2 lr; SGD's updates differ as little as the gradients do.
BASE = TINY[: TINY.index("--no-save")] + ["--optimizer", "sgd", "--lr", "0.5"]
BASE += ["--required-batch-size-multiple", "1", "--batch-size", "1"]
ONE = BASE + EMA + ["--update-freq", "4"]
TWO = BASE + EMA + ["--update-freq", "2", "--distributed-world-size", "2"]


def _rank(index, argv, world, port, out):
    """One rank of `train` (the real loop and checkpoints); in one process, the weights before
    the first update and after each (with whether the device skipped it) go to `out`."""
    from helpers import compose
    from trainer.rendezvous import Rendezvous
    from trainer.train import main
    from trainer.train.trainer import Trainer

    steps, step = [], Trainer.train_step

    def weights(model):
        return {n: p.detach().double().clone() for n, p in getattr(model, "module", model).named_parameters()}

    def recording(self, samples):
        if not steps:
            steps.append((False, weights(self.model)))
        update = step(self, samples)
        steps.append((bool(update.values()["bad"]), weights(self.model)))  # a host read: the test's
        return update

    if world == 1:
        Trainer.train_step = recording
    rdv = Rendezvous(
        f"tcp://127.0.0.1:{port}" if world > 1 else "", world, rank=index, local_rank=index, local_world_size=world
    )
    main.run(compose(argv), rdv)
    if world == 1:
        torch.save(steps, out)


def train(argv, world=1):
    """Run `train`; returns the weights of each update (one process only)."""
    from trainer.rendezvous import free_port

    out = Path(argv[argv.index("--save-dir") + 1]).parent / f"steps-{free_port()}.pt"
    run_ranks(_rank, (argv, world, free_port(), str(out)), world)
    return torch.load(out) if world == 1 else None


def fairseq_ema(steps, decay=DECAY, start=START, freq=FREQ):
    """fairseq's EMA.step after each update that counts (not an fp16 overflow): its counter
    of such updates (from 0 in a fresh run) gates --ema-update-freq, and the decay is 0 while
    the update count is below --ema-start-update. In float64, from the initial weights."""
    ema, n = dict(steps[0][1]), 0
    for bad, w in steps[1:]:
        if bad:
            continue
        n += 1
        if n % freq == 0:
            d = 0.0 if n < start else decay
            ema = {k: d * ema[k] + (1 - d) * w[k] for k in ema}
    return ema


def saved(path, ema=True):
    """{name: tensor} of a checkpoint's average (or weights), read as the inference commands do."""
    from trainer.formats.shardlm.reader import CheckpointReader

    reader = CheckpointReader(path, ema=ema)
    return {n: reader.get(n).double() for n in reader.specs}


def assert_close(a, b, tol=1e-6):
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < tol, f"differ by {worst:.3g}"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """8 updates in one process, validated on the average at the end; its weights per update."""
    save = tmp_path_factory.mktemp("one") / "ckpt"
    steps = train(ONE + ["--max-update", "8", "--validate-with-ema", "--save-dir", str(save)])
    return steps, save / "checkpoint_last"


def test_the_average_is_fairseqs_rule(one_process):
    steps, ckpt = one_process
    assert len(steps) == 9 and not any(bad for bad, _ in steps)
    ema = saved(ckpt)
    assert_close(ema, fairseq_ema(steps))
    # validated on the average, then trained on: the weights saved are the weights, not the average
    assert_close(saved(ckpt, ema=False), steps[-1][1])
    assert max((ema[k] - steps[-1][1][k]).abs().max().item() for k in ema) > 1e-3


def test_fsdp_ddp_one_process_and_resumes_across_them(one_process, tmp_path):
    """2 FSDP ranks for 8 updates, validated on the average at updates 3, 4 (saved), 6 and 8
    (with --no-reshard-after-forward a forward without backward leaves the layers gathered,
    and only a save's state_dict reshards them: training must not go on with the average's),
    == one process; resumed from update 4 in one process (saved at 6), from 6 on 2 DDP ranks
    (saved at 7), from 7 on 4 HSDP ranks (2 replicas of 2 shards, --cpu-offload): the same
    average at update 8."""
    _, reference = one_process
    expected = saved(reference)
    fsdp, one, ddp, again = tmp_path / "fsdp", tmp_path / "one", tmp_path / "ddp", tmp_path / "again"
    log = tmp_path / "fsdp.log"
    train(
        TWO
        + ["--ddp-backend", "fully_sharded", "--no-reshard-after-forward"]
        + ["--max-update", "8", "--save-interval-updates", "4", "--validate-interval-updates", "3"]
        + ["--validate-with-ema", "--batch-size-valid", "32", "--log-format", "json", "--log-file", str(log)]
        + ["--save-dir", str(fsdp)],
        2,
    )
    assert_close(saved(fsdp / "checkpoint_last"), expected)
    valid = [r for tag, r in parse_records(log.read_text()).items() if tag == "valid"][0]
    assert [r["valid_num_updates"] for r in valid] == [3, 4, 6, 8]
    one_valid = json.loads((reference / "trainer_state.json").read_text())["state"]["loop"]["best_valid_loss"]
    assert valid[-1]["valid_loss"] == pytest.approx(one_valid, abs=1e-3)
    train(
        ONE
        + ["--max-update", "6", "--save-interval-updates", "2", "--disable-validation", "--save-dir", str(one)]
        + ["--restore-file", str(fsdp / "checkpoint_1_4")]
    )
    train(
        TWO
        + ["--max-update", "7", "--disable-validation", "--save-dir", str(ddp)]
        + ["--restore-file", str(one / "checkpoint_1_6")],
        2,
    )
    hybrid = ["--ddp-backend", "hybrid_shard", "--shard-group-size", "2", "--cpu-offload"]
    train(
        BASE
        + EMA
        + ["--distributed-world-size", "4", "--update-freq", "1"]
        + hybrid
        + ["--max-update", "8", "--disable-validation", "--save-dir", str(again)]
        + ["--restore-file", str(ddp / "checkpoint_last")],
        4,
    )
    assert_close(saved(again / "checkpoint_last"), expected)


def _eval_lm(capsys, *args):
    import cli

    capsys.readouterr()
    code = cli.COMMANDS["eval-lm"]([str(a) for a in args])
    out, err = capsys.readouterr()
    found = re.search(r"Loss \(base 2\): ([0-9.]+)", out)
    return code or 0, float(found.group(1)) if found else None, err


def test_validate_with_ema_and_eval_lm_ema(one_process, tmp_path, capsys):
    """--validate-with-ema's valid loss is eval-lm --ema's, not the weights' (eval-lm); a
    checkpoint without an average (saved by a run without --store-ema that resumed one with
    it, which ignores it) is refused by --ema, and a --store-ema run resumed from it starts
    its average from the weights."""
    _, ckpt = one_process
    valid = json.loads((ckpt / "trainer_state.json").read_text())["state"]["loop"]["best_valid_loss"]
    _, ema_loss, _ = _eval_lm(capsys, "--path", ckpt, "--gen-subset", "valid", "--ema")
    _, weights_loss, _ = _eval_lm(capsys, "--path", ckpt, "--gen-subset", "valid")
    assert ema_loss == pytest.approx(valid, abs=1e-4)
    assert abs(weights_loss - valid) > 0.05

    plain = tmp_path / "plain"
    args = ["--update-freq", "4", "--max-update", "9", "--disable-validation", "--save-dir", str(plain)]
    steps = train(BASE + args + ["--restore-file", str(ckpt)])
    assert len(steps) == 2  # one update: the average was not in the way
    code, _, err = _eval_lm(capsys, "--path", plain / "checkpoint_last", "--gen-subset", "valid", "--ema")
    assert code != 0 and "holds no moving average of the weights" in err and "drop --ema" in err

    # export-model --ema writes the average; an export holds weights only, so --ema refuses it
    from safetensors.torch import load_file

    from trainer.inference.export import export_model

    export_model(ckpt, tmp_path / "export", ema=True)
    exported = {k: v.double() for k, v in load_file(tmp_path / "export" / "model.safetensors").items()}
    assert_close(exported, saved(ckpt))
    code, _, err = _eval_lm(capsys, "--path", tmp_path / "export", "--gen-subset", "valid", "--ema")
    assert code != 0 and "export-model output, which holds weights only: drop --ema" in err

    again = tmp_path / "again"
    args = ["--store-ema", "--ema-decay", "0.5", "--max-update", "10", "--disable-validation", "--update-freq", "4"]
    steps = train(BASE + args + ["--save-dir", str(again), "--restore-file", str(plain / "checkpoint_last")])
    assert_close(saved(again / "checkpoint_last"), fairseq_ema(steps, decay=0.5, start=0, freq=1))
    # a fresh start with --ema-seed-model starts from that checkpoint's average
    seeded = tmp_path / "seeded"
    args = ["--store-ema", "--ema-decay", "0.5", "--max-update", "1", "--disable-validation", "--update-freq", "4"]
    steps = train(BASE + args + ["--save-dir", str(seeded), "--ema-seed-model", str(ckpt)])
    steps[0] = (False, saved(ckpt))
    assert_close(saved(seeded / "checkpoint_last"), fairseq_ema(steps, decay=0.5, start=0, freq=1))


def test_an_fp16_overflow_does_not_move_the_average(tmp_path):
    """Updates skipped for an fp16 overflow are no updates of the average either, as in
    fairseq, and do not count towards --ema-update-freq: the average follows an fp16 update
    when its flags are read (Trainer.settle), which the host does late. The loss scale
    doubles after every update (--fp16-scale-window 1) until it overflows, once the average
    and the weights differ."""
    ema = ["--store-ema", "--ema-decay", str(DECAY), "--ema-update-freq", "2", "--ema-fp32"]
    args = ["--fp16", "--fp16-init-scale", "1024", "--fp16-scale-window", "1", "--update-freq", "1"]
    steps = train(
        BASE + ema + args + ["--max-update", "8", "--disable-validation", "--save-dir", str(tmp_path / "fp16")]
    )
    assert any(bad for bad, _ in steps[4:]), "no update overflowed once the average had moved"
    assert_close(saved(tmp_path / "fp16" / "checkpoint_last"), fairseq_ema(steps, start=0))
