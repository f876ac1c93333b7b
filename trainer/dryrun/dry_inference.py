"""The forwards of eval-lm, generate and serve on a fake GPU, through the commands' own code:
eval_lm() and generate() as the commands call them (their printed lines kept aside, stdout
carries the dry run's reports), and serve's engine (continuous batching over a KV cache,
scoring a prompt as lm-evaluation-harness does, then generating) behind its HTTP server.
A job's "argv" is the command's command line."""

import contextlib
import io

from trainer.config.commands import COMMAND_GROUPS
from trainer.config.flags import build_command_parser, parse_command
from trainer.inference.eval_lm import eval_lm
from trainer.inference.generate import generate
from trainer.inference.load import load_model, weights_dtype
from trainer.serve.command import check_cache_fits
from trainer.serve.engine import Engine, GenerationRequest


def command_args(command, argv):
    group, cls = COMMAND_GROUPS[command]
    return parse_command(build_command_parser(command, group, cls, command), group, cls, argv)


def printed(fn, *args):
    """fn(*args)'s last printed line (what the command tells its user)."""
    with contextlib.redirect_stdout(io.StringIO()) as out:
        fn(*args)
    lines = out.getvalue().splitlines()
    return lines[-1] if lines else ""


def dry_eval_lm(job, env, fake):
    return {"printed": printed(eval_lm, command_args("eval-lm", job["argv"]), env)}


def dry_generate(job, env, fake):
    return {"printed": printed(generate, command_args("generate", job["argv"]))}


def dry_serve(job, env, fake):
    """serve's engine over the model as serve loads it; its thread runs under the fake devices."""
    args = command_args("serve", job["argv"])
    model, _, tokenizer = load_model(args.path, env.device, dtype=weights_dtype(args), ema=args.ema)
    check_cache_fits(model, args)
    loop = Engine._loop

    def fake_loop(engine):
        with fake:
            loop(engine)

    Engine._loop = fake_loop
    try:
        with Engine(model, tokenizer, max_batch=args.max_batch, max_len=args.max_positions) as engine:
            prompt = tokenizer.encode("the quick brown fox")
            scored = engine.score(prompt, logprobs=1)
            done = engine.submit(GenerationRequest(prompt, max_tokens=2, temperature=0)).result()
    finally:
        Engine._loop = loop
    return {"printed": f"scored {len(scored)} prompt tokens, generated {len(done.tokens)} ({done.finish_reason})"}


COMMANDS = {"eval-lm": dry_eval_lm, "generate": dry_generate, "serve": dry_serve}
