"""generate (fairseq-interactive): text continuations sampled from a trained model."""
import sys

from models.generate import sample
from trainer.errors import UsageError
from trainer.inference.load import load_model


def generate(args):
    """Print the continuation of each prompt (--prompt, else one per line of stdin)."""
    # Prompts first: an empty stdin is refused before the model is loaded.
    prompts = args.prompt if args.prompt else [line.rstrip("\n") for line in sys.stdin]
    if not prompts:
        raise UsageError("no prompts: pass --prompt TEXT, or one prompt per line on stdin")
    model, _, tokenizer = load_model(args.path)
    if tokenizer is None:
        raise UsageError(f"{args.path} has no tokenizer (trained with --task dummy_lm?): nothing can "
                         "turn text into its tokens")
    for i, prompt in enumerate(prompts):
        # The model learned every block as "</s> sentence": start the prompt the same way.
        ids = [tokenizer.eos] + tokenizer.encode(prompt)
        try:
            new = sample(model, ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                         top_p=args.top_p, seed=args.seed + i, eos=tokenizer.eos, use_cache=not args.no_kv_cache)
        except ValueError as e:
            raise UsageError(str(e)) from None
        # Decoded whole: a piece's leading space belongs to the text around it.
        print(tokenizer.decode(ids[1:] + new), flush=True)
    return 0
