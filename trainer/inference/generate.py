"""generate (fairseq-interactive): text continuations sampled from a trained model or a
Hugging Face model directory (--temperature 0: greedy, transformers' do_sample=False)."""

import sys

from data.hf_tokenizer import HFTokenizer
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
        raise UsageError(
            f"{args.path} has no tokenizer (trained with --task dummy_lm?): nothing can turn text into its tokens"
        )
    # A Hugging Face tokenizer starts a text as its model learned texts start (Llama 3's
    # <|begin_of_text|>; nothing for Qwen3); a fairseq LM learned every block as "</s> sentence".
    start = [] if isinstance(tokenizer, HFTokenizer) else [tokenizer.eos]
    for i, prompt in enumerate(prompts):
        ids = start + tokenizer.encode(prompt)
        try:
            new = sample(
                model,
                ids,
                args.max_new_tokens,
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                seed=args.seed + i,
                eos=tokenizer.eos,
                bos=tokenizer.eos if tokenizer.bos is None else tokenizer.bos,
                use_cache=not args.no_kv_cache,
            )
        except ValueError as e:
            raise UsageError(str(e)) from None
        # Decoded whole: a piece's leading space belongs to the text around it.
        print(tokenizer.decode(ids[len(start) :] + new), flush=True)
    return 0
